"""The heartbeat wheel on a driven clock: an idle session hears a heartbeat every HEARTBEAT_S
(plus at most one tick), a busy one none, a closed one is forgotten."""

from __future__ import annotations

import pytest

from gateway.heartbeats import HeartbeatWheel


class FakeSession:
    """What the wheel sees of a session: its last send, closed, and heartbeat()."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.closed = False
        self.last_send = clock.t
        self.beats: list[float] = []

    def heartbeat(self) -> None:       # the sender sends the frame a moment later
        self.beats.append(self.clock.t)
        self.last_send = self.clock.t + 0.002


class Clock:
    def __init__(self) -> None:
        self.t = 5000.0

    def __call__(self) -> float:
        return self.t


def run(wheel: HeartbeatWheel, clock: Clock, until: float) -> None:
    """Tick as the wheel's task does: at each bucket's time (plus a little scheduling delay)."""
    while True:
        t = wheel._next_slot * wheel.tick_s + 0.003
        if t > until:
            return
        clock.t = max(clock.t, t)
        wheel.tick(clock.t)


@pytest.mark.parametrize("interval", [0.3, 2.0, 12.0])
def test_an_idle_session_hears_a_heartbeat_every_interval(interval):
    clock = Clock()
    wheel = HeartbeatWheel(interval, clock=clock)
    idle = FakeSession(clock)
    wheel.add(idle, idle.last_send + interval)
    start = clock.t
    run(wheel, clock, start + 20 * interval)
    gaps = [b - a for a, b in zip([start] + idle.beats, idle.beats)]
    assert len(idle.beats) >= 18
    assert all(interval - 0.05 <= g <= interval + wheel.tick_s + 0.01 for g in gaps), (wheel.tick_s, gaps)
    assert wheel.tick_s <= min(1.0, interval / 4)


def test_a_busy_session_gets_none_and_a_closed_one_is_dropped():
    clock = Clock()
    wheel = HeartbeatWheel(2.0, clock=clock)
    busy, gone = FakeSession(clock), FakeSession(clock)
    for s in (busy, gone):
        wheel.add(s, s.last_send + 2.0)
    gone.closed = True
    start = clock.t
    while clock.t < start + 10:
        busy.last_send = clock.t          # it sends something every 0.1 s
        run(wheel, clock, clock.t + 0.1)
        clock.t += 0.1
    assert busy.beats == [] and gone.beats == []
    assert all(gone not in bucket for bucket in wheel._buckets.values())
