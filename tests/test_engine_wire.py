"""The engine pipe's step-output format (worker.engine_wire): keyed msgpack columns. Every field of
`StepOutput` crosses under its own key, whatever mix of token outputs, finals, errors and
logprobs a step holds; keys a message does not carry decode to the usual values."""

from __future__ import annotations

from dataclasses import fields

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.errors import ErrorCode
from worker.engine import StepOutput
from worker.engine_wire import pack_outputs, unpack_outputs


def roundtrip(outs: list[StepOutput]) -> list[StepOutput]:
    """As the pipe does it: packed in the child, unpacked in the parent."""
    return unpack_outputs(msgpack.unpackb(msgpack.packb(["out", pack_outputs(outs)]))[1])


def test_every_field_has_its_own_key():
    keys = [f.metadata["key"] for f in fields(StepOutput)]
    assert all(keys) and len(set(keys)) == len(keys)


LOGPROBS = st.lists(st.tuples(st.text(max_size=3), st.floats(-50, 0), st.just([]), st.integers(0, 99)).map(list),
                    min_size=1, max_size=2)
TOKEN = st.builds(lambda i, text, lp: StepOutput(f"r{i}", text, [i], False, None, 7, i, emitted_ms=1000 + i,
                                                   logprobs=lp),
                  st.integers(0, 10**6), st.text(max_size=4), st.none() | LOGPROBS)
FINAL = st.builds(lambda i, reason, cached, admitted: StepOutput(f"f{i}", "", [], True, reason, 9, i, emitted_ms=5,
                                                                  cached_tokens=cached, admitted_ms=admitted),
                  st.integers(0, 99), st.sampled_from(["stop", "length", "cancelled"]), st.integers(0, 9),
                  st.integers(0, 10**12))
ERROR = st.builds(lambda i, code: StepOutput(f"e{i}", "", [], True, "error", 3, 0, code, f"failed {i}", 7),
                  st.integers(0, 99), st.sampled_from([ErrorCode.INTERNAL, ErrorCode.CONTEXT_TOO_LONG]))


@settings(max_examples=120, deadline=None, derandomize=True)
@given(st.lists(TOKEN | FINAL | ERROR, max_size=40))
def test_any_mix_of_outputs_crosses_exactly(outs):
    back = roundtrip(outs)
    assert back == outs
    assert all(type(o.token_ids) is list for o in back)
    assert all(o.error_code is None or type(o.error_code) is ErrorCode for o in back)


def test_a_field_every_output_sets_is_sent_once_as_a_column_and_one_no_output_sets_not_at_all():
    lp = [[" a", -0.5, [], 0]]
    outs = [StepOutput(f"r{i}", " a", [i], False, None, 3, 1, emitted_ms=9, logprobs=lp) for i in range(4)]
    cols = pack_outputs(outs)
    assert cols["lp"][0] is None and list(cols["lp"][1]) == [lp] * 4
    assert not {"f", "fr", "ec", "em", "ct", "a"} & set(cols)
    assert roundtrip(outs) == outs


def test_absent_keys_are_the_usual_values():
    cols = {"r": ["x"], "t": ["hi"], "i": [[4]], "p": [2], "c": [1], "e": [77]}
    assert unpack_outputs(cols) == [StepOutput("x", "hi", [4], False, None, 2, 1, emitted_ms=77)]
    assert unpack_outputs({}) == [] and pack_outputs([]) == {}
