"""Seeded random request fields for the live fuzz of tests/test_gateway_fuzz.py (issue 34 item 7):
JSON schemas (valid, odd, broken, too large, slow to compile), `response_format` wrappers, tool
definitions with `tool_choice`, and logprobs fields, valid and not. Plain functions of a
`random.Random`, so a failing case is reproduced by its seed and index.
"""

from __future__ import annotations

import random

ODD_STRINGS = ["", "a", "Zürich", "東京", "🎉", "e\u0301", "\u202eabc", "x" * 40, "\"quoted\"", "back\\slash"]
SCALARS = [None, True, False, 0, -1, 7, 2**40, 1.5, -0.0, *ODD_STRINGS[:6]]


def scalar(rng: random.Random):
    return rng.choice(SCALARS)


def name(rng: random.Random) -> str:
    return rng.choice(["a", "name", "age", "x_1", "ключ", "with space", "", "$ref", "type"]) + rng.choice(["", "2"])


def schema(rng: random.Random, depth: int = 0) -> object:
    """A random JSON schema: mostly what xgrammar compiles, some it refuses, a few odd shapes."""
    kinds = ["object", "string", "integer", "number", "boolean", "enum", "array", "anyOf", "const", "ref", "junk"]
    kind = rng.choice(kinds if depth < 2 else kinds[1:6])
    if kind == "object":
        props = {name(rng): schema(rng, depth + 1) for _ in range(rng.randint(0, 3))}
        out: dict = {"type": "object", "properties": props}
        if props and rng.random() < 0.7:
            out["required"] = rng.sample(sorted(props), rng.randint(1, len(props)))
        if rng.random() < 0.1:
            out["required"] = ["not-a-property"]
        if rng.random() < 0.2:
            out["additionalProperties"] = rng.choice([True, False, {"type": "integer"}])
        return out
    if kind == "string":
        out = {"type": "string"}
        if rng.random() < 0.5:
            out["maxLength"] = rng.choice([0, 1, 5, 12, -1, "x"])
        if rng.random() < 0.3:
            out["minLength"] = rng.choice([0, 2, 8, 20])
        if rng.random() < 0.2:
            out["pattern"] = rng.choice(["^[a-z]{1,6}$", "((", "^\\d+$", "[", "^(a|b)*$", "(?<=x)y"])
        if rng.random() < 0.1:
            out["format"] = rng.choice(["email", "date", "uuid", "nonsense"])
        return out
    if kind in ("integer", "number"):
        out = {"type": kind}
        lo, hi = rng.choice([(0, 10), (5, 1), (-2**60, 2**60), (0.5, 2.5), (None, 3)])
        if lo is not None:
            out["minimum"] = lo
        out["maximum"] = hi
        if rng.random() < 0.2:
            out["exclusiveMinimum"] = rng.choice([True, 0, "x"])
        return out
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": [scalar(rng) for _ in range(rng.randint(0, 4))]}
    if kind == "array":
        out = {"type": "array", "items": schema(rng, depth + 1)}
        lo, hi = rng.choice([(0, 3), (2, 1), (1, 1), (None, 2), (0, None)])
        if lo is not None:
            out["minItems"] = lo
        if hi is not None:
            out["maxItems"] = hi
        return out
    if kind == "anyOf":
        return {"anyOf": [schema(rng, depth + 1) for _ in range(rng.randint(0, 3))]}
    if kind == "const":
        return {"const": scalar(rng)}
    if kind == "ref":
        return rng.choice([{"$ref": "#/$defs/missing"}, {"$ref": "http://example.com/s.json"},
                           {"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"}])
    return rng.choice([{"type": "nonsense"}, {"type": ["string", "null"]}, {"not": {"type": "string"}}, {},
                       {"type": 5}, {"allOf": [{"type": "string"}, {"type": "integer"}]}, True, False])


def big_schema(rng: random.Random, size: int) -> dict:
    """An object schema of about `size` bytes (over a worker's GRAMMAR_MAX_SCHEMA_BYTES)."""
    count = size // 24 + 1
    return {"type": "object", "properties": {f"f{rng.randrange(10**6)}_{i}": {"type": "integer"} for i in range(count)}}


def slow_schema(rng: random.Random) -> dict:
    """The documented slow kind: a large counted repetition (seconds to compile, or a timeout)."""
    return {"type": "object", "properties": {"s": {"type": "string", "minLength": rng.randint(8000, 12000)}},
            "required": ["s"]}


def response_format(rng: random.Random, *, big_bytes: int, valid: bool = True):
    """A `response_format`: valid, OpenAI's json_schema shape around a random schema (which the
    worker may still refuse), sometimes a too-large one, or json_object / text; not valid, a
    malformed wrapper. (Slow schemas are the caller's to add, a counted few: each holds a compile
    thread for seconds.)"""
    if not valid:
        return rng.choice([{"type": "json_schema"}, {"type": "yaml"}, "json", 5, [],
                           {"type": "json_schema", "json_schema": {"schema": {}}},
                           {"type": "json_schema", "json_schema": {"name": "x" * 70, "schema": {}}},
                           {"type": "json_schema", "json_schema": {"name": "x", "schema": []}},
                           {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}}])
    roll = rng.random()
    if roll < 0.1:
        return {"type": "json_schema", "json_schema": {"name": "big", "schema": big_schema(rng, big_bytes)}}
    if roll < 0.25:
        return rng.choice([{"type": "json_object"}, {"type": "text"}])
    return {"type": "json_schema", "json_schema": {"name": rng.choice(["out", "a-b", "ok_1"]), "schema": schema(rng),
                                                   **({"strict": rng.choice([True, False])} if rng.random() < 0.5 else {})}}


def tools(rng: random.Random, *, big_bytes: int, valid: bool = True) -> dict:
    """`tools` and `tool_choice`: valid, 1-3 functions with random parameters (too large
    sometimes) and a choice that names one of them or none; not valid, a bad name, type or choice."""
    fns = []
    for i in range(rng.randint(1, 3)):
        params = big_schema(rng, big_bytes) if rng.random() < 0.1 else \
            rng.choice([None, schema(rng), {"type": "object", "properties": {name(rng): schema(rng, 1)}}])
        fn = {"name": rng.choice(["get_weather", "f", "lookup-2"]) + str(i)}
        if params is not None:
            fn["parameters"] = params
        if rng.random() < 0.3:
            fn["description"] = rng.choice(ODD_STRINGS)
        fns.append({"type": "function", "function": fn})
    choice = rng.choice([None, "none", "auto", "required", "required",
                         {"type": "function", "function": {"name": rng.choice(fns)["function"]["name"]}}])
    if not valid:
        bad = rng.randrange(4)
        if bad == 0:
            fns[0]["function"]["name"] = rng.choice(["bad name!", "", "x" * 70, "ünï"])
        elif bad == 1:
            fns[0]["type"] = "retrieval"
        elif bad == 2:
            choice = rng.choice([{"type": "function", "function": {"name": "nope"}}, "bogus", 3])
        else:
            fns = []
            choice = "required"
    out: dict = {"tools": fns}
    if choice is not None:
        out["tool_choice"] = choice
    return out


def logprobs(rng: random.Random, valid: bool = True) -> dict:
    """`logprobs` / `top_logprobs` (chat's shape): valid values, or wrong types and ranges."""
    if valid:
        out = {"logprobs": rng.choice([True, True, False])}
        if out["logprobs"] and rng.random() < 0.7:
            out["top_logprobs"] = rng.choice([0, 1, 5, 20])
        return out
    return rng.choice([{"logprobs": "yes"}, {"logprobs": 1}, {"logprobs": None}, {"top_logprobs": 3},
                       {"logprobs": True, "top_logprobs": rng.choice([21, -1, 1000, "3", 2.5])}])
