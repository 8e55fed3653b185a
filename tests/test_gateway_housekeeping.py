"""The gateway's housekeeping duties run independently (a failing one never skips another, and
is counted per duty), and a request's phases move only along their transitions."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.flusher import ChunkBuffer
from gateway.housekeeping import Duty, Housekeeping, gateway_duties
from gateway.metrics import HOUSEKEEPING_DUTIES, GatewayMetrics
from gateway.request_log import CancelWatch
from gateway.request_state import IllegalTransition, Phase, RequestState
from gateway.settings import GatewaySettings


def failures(metrics: GatewayMetrics, duty: str) -> float:
    return metrics.registry.get_sample_value("gateway_housekeeping_failures_total", {"duty": duty}) or 0.0


async def test_a_failing_duty_is_counted_and_skips_no_other_duty():
    metrics = GatewayMetrics()
    runs = {"ok": 0, "redis": 0, "bug": 0}

    def ok(now: float) -> None:
        runs["ok"] += 1

    async def redis_down(now: float) -> None:
        runs["redis"] += 1
        raise RedisConnectionError("Redis is away")

    def bug(now: float) -> None:
        runs["bug"] += 1
        raise KeyError("a bug in one duty")

    housekeeping = Housekeeping([Duty("orphans", 0.01, redis_down), Duty("leases", 0.01, bug),
                                 Duty("routing", 0.01, ok)], metrics)
    housekeeping.start()
    try:
        for _ in range(500):
            if min(runs.values()) >= 5:
                break
            await asyncio.sleep(0.01)
    finally:
        await housekeeping.stop()
    assert min(runs.values()) >= 5, runs           # the failing duties go on being run, and so does the other
    assert failures(metrics, "orphans") == runs["redis"]
    assert failures(metrics, "leases") == runs["bug"]
    assert failures(metrics, "routing") == 0


async def test_each_duty_has_its_own_interval():
    metrics = GatewayMetrics()
    runs = {"fast": 0, "slow": 0}
    housekeeping = Housekeeping([Duty("fast", 0.01, lambda now: runs.__setitem__("fast", runs["fast"] + 1)),
                                 Duty("slow", 10.0, lambda now: runs.__setitem__("slow", runs["slow"] + 1))], metrics)
    housekeeping.start()
    try:
        await asyncio.sleep(0.3)
    finally:
        await housekeeping.stop()
    assert runs["fast"] >= 5 and runs["slow"] == 0


def test_the_gateway_duties_are_the_ones_metrics_count():
    s = GatewaySettings(request_stall_s=5)
    watch = CancelWatch(GatewayMetrics(), expire_s=1)
    duties = gateway_duties(s, sessions=None, cancel_watch=watch, submitter=None, liveness=None, router=None,
                            metrics=None, read_backlog=None, batches=lambda now: None)
    assert [d.name for d in duties] == list(HOUSEKEEPING_DUTIES)
    assert {d.name: d.interval_s for d in duties}["liveness"] == s.gateway_heartbeat_s
    assert {d.name: d.interval_s for d in duties}["leases"] == pytest.approx(s.concurrency_lease_s / 3)
    without_stalls = gateway_duties(GatewaySettings(request_stall_s=0), sessions=None, cancel_watch=watch,
                                    submitter=None, liveness=None, router=None, metrics=None, read_backlog=None)
    assert "stalls" not in [d.name for d in without_stalls]      # REQUEST_STALL_S=0: no stall watchdog


def request() -> RequestState:
    return RequestState("c1", "r" * 32, "key", ChunkBuffer(0.04, 8))


def test_a_request_moves_through_its_phases_in_order():
    req = request()
    assert req.phase is Phase.OPENING and not req.slot_held and not req.streaming and not req.finished
    req.advance(Phase.STARTED)
    assert req.slot_held and not req.streaming
    req.advance(Phase.STREAMING)
    assert req.slot_held and req.streaming and not req.finished
    req.cancelling("client")               # a cancel is no phase: the request streams until its final
    assert req.cancel_requested and req.streaming and req.cancel_origin == "client"
    req.advance(Phase.ENDED)
    assert req.finished and not req.slot_held and not req.streaming


@pytest.mark.parametrize("path", [
    [Phase.STREAMING],                                  # accepted before it was queued
    [Phase.STARTED, Phase.STARTED],
    [Phase.ENDED, Phase.STARTED],                       # nothing follows the end
    [Phase.STARTED, Phase.STREAMING, Phase.STARTED],
])
def test_a_transition_out_of_order_is_refused(path):
    req = request()
    with pytest.raises(IllegalTransition):
        for phase in path:
            req.advance(phase)


def test_a_refused_or_dropped_request_ends_from_any_live_phase():
    for before in ([], [Phase.STARTED], [Phase.STARTED, Phase.STREAMING]):
        req = request()
        for phase in before:
            req.advance(phase)
        req.advance(Phase.ENDED)
        assert req.finished
