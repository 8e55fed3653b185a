"""llguidance vs xgrammar on SmolLM2's vocabulary (49k tokens): what a constrained request costs.

For each schema: the compile time (cold: a fresh compiler, no cache) and, walking a valid
document token by token as a model would produce it, the time to fill one row's token bitmask
and to advance the matcher by the sampled token (the per-step host cost of one constrained row).
The document is the same token ids for both libraries. Prints a table and, with --json, the
figures. Usage: .venv/bin/python bench/grammar_libs.py [--json out.json] (llguidance is the peer, not a
dependency: `.venv/bin/python -m pip install llguidance` first)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEMAS = {
    "json_object": ({"type": "object"},
                    {"name": "lighthouse", "tags": ["sea", "light"], "height": 42, "lit": True}),
    "nested": ({"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                 "required": ["name", "age"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]}},
        "required": ["user", "address"]},
        {"user": {"name": "Ada Lovelace", "age": 36}, "address": {"city": "London", "zip": "W1"}}),
    "enum_array": ({"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "sizes": {"type": "array", "items": {"type": "integer"}, "maxItems": 8},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "id": {"type": "integer"}, "label": {"type": "string"}}, "required": ["id", "label"]}}},
        "required": ["color", "sizes", "items"]},
        {"color": "green", "sizes": [1, 2, 3], "items": [{"id": 1, "label": "first"}, {"id": 2, "label": "second"}]}),
}


def load_tokenizer():
    from transformers import AutoTokenizer
    from worker.engine.model_files import SMOLLM2_GGUF, smollm2_dir
    return AutoTokenizer.from_pretrained(str(smollm2_dir()), gguf_file=SMOLLM2_GGUF)


def walk_document(ids: list[int], fill, accept, why) -> dict:
    """Per token of a valid document: `fill()` the row's bitmask, then `accept(token)` (False: the
    grammar refused it, `why(token)` says what). Medians (and the fill's p99) in microseconds."""
    fills, steps = [], []
    for t in ids:
        a = time.perf_counter()
        fill()
        b = time.perf_counter()
        ok = accept(t)
        c = time.perf_counter()
        assert ok, why(t)
        fills.append(b - a)
        steps.append(c - a)
    return {"fill_us": statistics.median(fills) * 1e6, "fill_p99_us": sorted(fills)[int(0.99 * (len(fills) - 1))] * 1e6,
            "step_us": statistics.median(steps) * 1e6, "tokens": len(ids)}


def bench_llguidance(tok, vocab: int, docs: dict) -> dict:
    import llguidance
    import llguidance.hf
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    setup = time.perf_counter() - t0
    out = {"tokenizer_setup_s": setup}
    for name, (schema, _doc) in SCHEMAS.items():
        ids = docs[name]
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_s = time.perf_counter() - t0
        assert not matcher.is_error(), matcher.get_error()
        mask = allocate_token_bitmask(1, vocab)
        out[name] = {"compile_ms": compile_s * 1e3, **walk_document(
            ids, lambda: fill_next_token_bitmask(matcher, mask, 0), matcher.consume_token,
            lambda t: (name, tok.decode([t]), matcher.get_error()))}
    return out


def bench_xgrammar(tok, vocab: int, docs: dict) -> dict:
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    setup = time.perf_counter() - t0
    out = {"tokenizer_setup_s": setup}
    for name, (schema, _doc) in SCHEMAS.items():
        ids = docs[name]
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        t0 = time.perf_counter()
        if name == "json_object":
            compiled = compiler.compile_builtin_json_grammar()
        else:
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        matcher = xgr.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - t0
        mask = xgr.allocate_token_bitmask(1, vocab)
        out[name] = {"compile_ms": compile_s * 1e3, **walk_document(
            ids, lambda: matcher.fill_next_token_bitmask(mask, 0), matcher.accept_token,
            lambda t: (name, tok.decode([t])))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    tok = load_tokenizer()
    vocab = len(tok)
    docs = {}
    for name, (_schema, doc) in SCHEMAS.items():
        text = json.dumps(doc, separators=(",", ":"))
        docs[name] = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    results = {"vocab": vocab, "llguidance": bench_llguidance(tok, vocab, docs), "xgrammar": bench_xgrammar(tok, vocab, docs)}
    print(f"vocabulary: {vocab} tokens (SmolLM2); per-token figures are medians over a valid document")
    print(f"{'library':<11} {'schema':<12} {'compile ms':>10} {'fill us':>8} {'fill p99':>9} {'fill+advance us':>16} {'tokens':>7}")
    for lib in ("llguidance", "xgrammar"):
        print(f"{lib:<11} {'(tokenizer)':<12} {results[lib]['tokenizer_setup_s'] * 1e3:>10.0f}")
        for name in SCHEMAS:
            r = results[lib][name]
            print(f"{lib:<11} {name:<12} {r['compile_ms']:>10.1f} {r['fill_us']:>8.0f} {r['fill_p99_us']:>9.0f} "
                  f"{r['step_us']:>16.0f} {r['tokens']:>7}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
