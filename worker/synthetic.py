"""A GPU-paced stand-in for the engine, behind the REAL worker service (for benchmarks).

Why: a CPU box cannot decode at GPU speed, but the transport (intake, output writer,
coalescing, inbox fan-out, gateway) must be measured at GPU speed. `SyntheticEngine` has the
engine's public API (add / step / cancel / has_work / ...) and emits one token per running
request per step, `step_ms` apart (2-5 ms = a small model at batch 64-256 on one GPU), with
realistic token text (common English word pieces, a few bytes each). Everything else is the
production worker: `python -m worker.synthetic` reads requests from the request stream (so a
real gateway submits to it), writes v2 events through worker.output_writer, honours cancel,
attach, failover (a continuation's `generated_ids` count as tokens already made: the text is a
function of the token index) and drains on SIGTERM.

    STREAM_PREFIX=llm REDIS_URL=redis://127.0.0.1:6379/0 WORKER_FLUSH_MS=15 \\
        python -m worker.synthetic --step-ms 5 --max-batch 1024

The achieved step time is logged every 10 s (a busy box may not keep the pace; report it).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import signal
import sys
import time
from collections import deque

from worker.engine import EngineRequest, StepOutput

log = logging.getLogger("worker.synthetic")

# common sub-word pieces of English text (what BPE tokens of chat output look like)
PIECES = [" the", " of", " and", " to", " a", " in", " is", " that", " for", " it", " with", " as", " was",
          " on", " be", " at", " by", " this", " had", " not", " are", " but", " from", " or", " have",
          " an", " they", " which", " one", " you", " were", " her", " all", " she", " there", " would",
          " their", " we", " him", " been", " has", " when", " who", " will", " more", " no", " if", " out",
          "ing", "ed", "ly", "er", "s", ",", ".", " model", " stream", " token", " Redis", " gateway"]


class WordTokenizer:
    """Enough of a tokenizer for EngineThread: one id per whitespace-separated word."""
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [hash(w) % 50_000 for w in text.split()] or [0]}


def token_at(index: int) -> tuple[int, str]:
    """The index-th generated token (same for every request, so a replay is identical)."""
    i = (index * 7919) % len(PIECES)
    return i, PIECES[i]


class SyntheticEngine:
    def __init__(self, *, max_batch: int, step_ms: float, host_us_per_row: float = 0.0):
        self.tokenizer = WordTokenizer()
        self.max_batch = max_batch
        self.step_s = step_ms / 1000
        self.host_s_per_row = host_us_per_row / 1e6
        self._running: dict[str, list] = {}    # rid -> [request, tokens generated]
        self._waiting: deque[EngineRequest] = deque()
        self._finals: list[StepOutput] = []
        self._next = time.monotonic()
        self.steps = 0
        self.last_step: tuple[int, int, int, int] | None = None   # as Engine.last_step (metrics)
        self._window = (time.monotonic(), 0)

    # ---- the engine's public API ----

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._finals)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def request_ids(self) -> list[str]:
        return list(self._running) + [r.rid for r in self._waiting]

    @property
    def kv_tokens_total(self) -> int:
        return self.max_batch * 4096

    @property
    def kv_tokens_used(self) -> int:
        return len(self._running) * 64

    @property
    def preemptions(self) -> int:
        return 0  # no KV pool to run out of

    def add(self, req: EngineRequest) -> None:
        self._waiting.append(req)

    def cancel(self, rid: str) -> bool:
        if rid in self._running:
            req, n = self._running.pop(rid)
        else:
            req = next((r for r in self._waiting if r.rid == rid), None)
            if req is None:
                return False
            self._waiting.remove(req)
            n = 0
        self._finals.append(StepOutput(rid, "", [], True, "cancelled", len(req.prompt_ids), n))
        return True

    def step(self) -> list[StepOutput]:
        now = time.monotonic()
        if now < self._next:
            time.sleep(self._next - now)          # the "GPU" is busy for the rest of the step
        self._next = max(self._next + self.step_s, time.monotonic())
        if self.host_s_per_row and self._running:
            # the real engine's Python work per row (schedule, inputs, sampling, detokenize):
            # it holds the GIL, as that does, while the "device" step above released it
            end = time.perf_counter() + self.host_s_per_row * len(self._running)
            while time.perf_counter() < end:
                pass
        outputs, self._finals = self._finals, []
        while self._waiting and len(self._running) < self.max_batch:
            req = self._waiting.popleft()
            self._running[req.rid] = [req, len(req.generated_ids)]   # a continuation goes on from there
        rows = len(self._running)
        for rid, slot in list(self._running.items()):
            req, n = slot
            n = slot[1] = n + 1
            tid, text = token_at(n)
            done = n >= req.params.max_tokens
            if done:
                del self._running[rid]
            if n <= req.skip_tokens and not done:
                continue
            suppressed = n <= req.skip_tokens
            outputs.append(StepOutput(rid, "" if suppressed else text, [] if suppressed else [tid], done,
                                      "length" if done else None, len(req.prompt_ids), n))
        self.steps += 1
        self.last_step = (rows, 0, rows, rows)
        self._report()
        return outputs

    def _report(self) -> None:
        t0, s0 = self._window
        now = time.monotonic()
        if now - t0 >= 10:
            log.info("synthetic engine: %.2f ms/step over the last %.0f s (target %.1f), %d running",
                     (now - t0) * 1000 / max(1, self.steps - s0), now - t0, self.step_s * 1000, len(self._running))
            self._window = (now, self.steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--max-batch", type=int, default=1024)
    parser.add_argument("--host-us-per-row", type=float, default=0.0,
                        help="Python time a step spends per running row, holding the GIL (the real engine: "
                             "~15-25 µs, bench/engine_host.py); overlapped with the next step's device time")
    args = parser.parse_args()
    from shared.config import get_settings
    from shared.logs import configure
    from worker.engine_process import start_engine
    from worker.service import WorkerService
    base = get_settings()
    # room for a few steps of every stream, so the output buffers never throttle the pace
    settings = base.model_copy(update={"max_batch": args.max_batch,
                                       "output_buffer_max": max(base.output_buffer_max, 8 * args.max_batch)})
    configure("worker")
    log.info(settings.log_line("synthetic worker"))
    engine = start_engine(functools.partial(SyntheticEngine, max_batch=args.max_batch, step_ms=args.step_ms,
                                            host_us_per_row=args.host_us_per_row), settings)
    service = WorkerService(settings, engine, model_name=f"synthetic-{args.step_ms:g}ms")

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.request_stop)
        await service.run()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
