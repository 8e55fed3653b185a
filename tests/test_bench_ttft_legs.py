"""bench/ttft_legs.py's split of one request's TTFT from Redis MONITOR lines and the client's
times: each leg is taken between the right commands (the claim is not the commit)."""

from bench.ttft_legs import WARM_UP, legs_of

RID = "ab" * 16


def test_legs_are_taken_between_the_right_commands():
    t0 = 1000.0
    lines = [
        (t0 + 0.0010, f"EVALSHA submit 4 p:{{q}}:rate p:{{q}}:conc p:{{q}}:requests ... {RID}"),
        (t0 + 0.0011, f"XADD p:{{q}}:requests MAXLEN ~ 100000 * d ...{RID}..."),
        (t0 + 0.0020, f"EVALSHA claim 3 p:{{r:{RID}}}:meta"),                # the worker's claim
        (t0 + 0.0052, f"EVALSHA commit 4 p:{{r:{RID}}}:out"),                # carries the first token
        (t0 + 0.0090, f"EVALSHA commit 5 p:{{r:{RID}}}:out"),                # the final
        (t0 + 0.0030, "XADD p:{q}:requests * d other-request"),
    ]
    warm = [("w", t0 - 1, t0 - 1, t0 - 1)] * WARM_UP
    rows = warm + [(RID, t0, t0 + 0.0019, t0 + 0.0061)]
    emitted_ms = 1000004        # the engine's stamp, t0 + 4 ms

    legs = legs_of(rows, lines, lambda rid: [{"k": "tok", "ms": emitted_ms}])
    assert len(legs) == 1
    got = {k: round(v, 3) for k, v in legs[0].items()}
    assert got == {"gw_in": 1.1, "accepted": 0.8, "worker_in": 0.9, "engine": 2.0, "worker_out": 1.2,
                   "gw_out": 0.9, "submit": 1.9, "deliver": 2.1, "hop": 4.0}


def test_a_request_without_its_commit_or_first_token_is_left_out():
    t0 = 1000.0
    lines = [(t0 + 0.001, f"XADD p:{{q}}:requests * d {RID}"), (t0 + 0.002, f"EVALSHA claim 1 p:{{r:{RID}}}:meta")]
    rows = [("w", 0, 0, 0)] * WARM_UP + [(RID, t0, t0 + 0.002, t0 + 0.006)]
    assert legs_of(rows, lines, lambda rid: [{"k": "tok", "ms": 1000004}]) == []
    assert legs_of(rows, lines, lambda rid: [{"k": "done", "ms": 1000004}]) == []
