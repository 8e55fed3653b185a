"""What the engine reports about its own work, for the worker's metrics (worker.metrics).

Why its own module: the engine runs in a child process (worker.engine_process) or a thread
(worker.engine_thread), and its figures must reach the worker's /metrics without costing per
token. The engine thread keeps a `Telemetry` and adds ONE record a step (batch size, prompt and
decode tokens, step time) and one per applied cancel (how long after the worker received it
the request's KV blocks were free), and one per grammar compile and per refused grammar
(worker.engine.grammar_compile); the engine process ships what accumulated with the messages
that already cross its pipe (each step's outputs, or the periodic status), as plain lists. Lane
counts and KV figures are gauges, sampled at most every `GAUGES_EVERY_S`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

GAUGES_EVERY_S = 0.5
LANES = ("interactive", "batch")


@dataclass
class Telemetry:
    # one per forward pass: (rows, prompt tokens computed, decode rows, tokens sampled, seconds)
    steps: list[tuple[int, int, int, int, float]] = field(default_factory=list)
    # one per cancel the engine applied: seconds from the worker receiving it to the KV freed
    cancels: list[float] = field(default_factory=list)
    # gauges (latest sample): running / waiting requests by lane, KV blocks cached (evictable)
    running: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    kv_cached: int = 0
    sampled_at: float = 0.0
    # structured output: seconds of each grammar compile, and the reason of each refused grammar
    compiles: list[float] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)

    def record_step(self, rows: int, prompt_tokens: int, decode_tokens: int, sampled: int, seconds: float) -> None:
        self.steps.append((rows, prompt_tokens, decode_tokens, sampled, seconds))

    def record_cancel(self, received_at: float) -> None:
        """A cancel the engine applied now (its blocks are free); `received_at`: time.time()
        when the worker received it (0: unknown, not recorded)."""
        if received_at:
            self.cancels.append(max(0.0, time.time() - received_at))

    def sample_gauges(self, engine, now: float) -> None:
        """Lane counts and cached KV from the engine (O(running + waiting)), at most every
        GAUGES_EVERY_S: never per step at GPU pace."""
        if now - self.sampled_at < GAUGES_EVERY_S:
            return
        self.sampled_at = now
        self.running, self.waiting = lane_counts(engine)
        self.kv_cached = int(getattr(engine, "kv_tokens_cached", 0))

    def take(self) -> "Telemetry":
        """What accumulated since the last take (the gauges are copied, not reset)."""
        out = Telemetry(self.steps, self.cancels, dict(self.running), dict(self.waiting), self.kv_cached,
                        self.sampled_at, self.compiles, self.refusals)
        self.steps, self.cancels, self.compiles, self.refusals = [], [], [], []
        return out

    def merge(self, other: "Telemetry") -> None:
        self.steps.extend(other.steps)
        self.cancels.extend(other.cancels)
        self.compiles.extend(other.compiles)
        self.refusals.extend(other.refusals)
        if other.sampled_at >= self.sampled_at:
            self.running, self.waiting = other.running, other.waiting
            self.kv_cached, self.sampled_at = other.kv_cached, other.sampled_at

    # ---- the pipe (msgpack-friendly lists) ----

    def pack(self) -> list:
        return [self.steps, self.cancels, [self.running.get(lane, 0) for lane in LANES],
                [self.waiting.get(lane, 0) for lane in LANES], self.kv_cached, self.sampled_at, self.compiles,
                self.refusals]

    @classmethod
    def unpack(cls, f) -> "Telemetry":
        return cls([tuple(s) for s in f[0]], list(f[1]), dict(zip(LANES, f[2])), dict(zip(LANES, f[3])), f[4], f[5],
                   list(f[6]), list(f[7]))


def lane_counts(engine) -> tuple[dict[str, int], dict[str, int]]:
    """(running, waiting) requests by lane, from an engine's scheduler (empty without one)."""
    scheduler = getattr(engine, "scheduler", None)
    if scheduler is None:
        return {"interactive": int(getattr(engine, "num_running", 0))}, \
            {"interactive": int(getattr(engine, "num_waiting", 0))}
    running = dict.fromkeys(LANES, 0)
    waiting = dict.fromkeys(LANES, 0)
    for seq in scheduler.running:
        running[seq.lane] = running.get(seq.lane, 0) + 1
    for seq in scheduler.waiting:
        waiting[seq.lane] = waiting.get(seq.lane, 0) + 1
    return running, waiting
