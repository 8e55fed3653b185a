"""The engine's own thread: the only place `Engine` methods are called (it is not thread-safe).
An `EngineClient` (worker.engine_client); in the worker process with ENGINE_PROCESS=false, and
inside the engine process otherwise (worker.engine_process).

The asyncio side (Redis I/O) talks to it through a thread-safe inbox of add/cancel/drop commands
that is drained before every step, so a cancel takes effect at the next step boundary. Step
outputs go out through a bounded buffer: when the writer cannot keep up (Redis down), the
engine pauses instead of growing memory without bound, and resumes when the buffer drains.

Pacing (`pace_s`, the worker's WORKER_FLUSH_MS): the outputs of several steps are delivered
together, at most every `pace_s`, so the service is woken once per flush tick, not once per
step. A request's first token and every final are delivered at once; a step long enough that
waiting for the next one would overshoot the tick by more than a tick delivers at its end; an
engine with nothing left to step delivers what it holds before it sleeps. On a 2-core CPU box
every wake-up of another process (the worker's loop, then its Redis commit, Redis and the
gateway) costs 0.1-0.4 ms of CPU taken from a two-thread decode step, so one user's 10 ms
tokens paid one of each per token (bench/RESULTS.md, "Wake-ups per token").
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable

from shared.errors import ErrorCode
from shared.logs import rid_of
from worker.engine import EngineRejected, EngineRequest, StepOutput, build_prompt_ids
from worker.engine_client import Add, Cancel
from worker.telemetry import GAUGES_EVERY_S, Telemetry
from worker.tokenization import answer

__all__ = ["Add", "Cancel", "EngineThread", "error_output", "on_loop"]

if TYPE_CHECKING:
    from worker.engine import Engine

log = logging.getLogger("worker.engine")

FAILED_STEPS_UNHEALTHY = 3   # consecutive steps that only failed before the engine is declared unhealthy


def error_output(rid: str, code: ErrorCode, message: str, prompt_tokens: int = 0, *,
                 param: str | None = None) -> StepOutput:
    return StepOutput(rid=rid, text="", token_ids=[], finished=True, finish_reason="error",
                      prompt_tokens=prompt_tokens, completion_tokens=0, error_code=code, error_message=message,
                      error_param=param)


class EngineThread:
    def __init__(self, engine: Engine, *, max_prompt_tokens: int, buffer_max: int,
                 on_output: Callable[[], None] | None = None):
        self.engine = engine
        self.max_prompt_tokens = max_prompt_tokens
        self.buffer_max = buffer_max
        self._on_output = on_output or (lambda: None)   # called (from this thread) when outputs are buffered
        self._inbox: deque = deque()
        self._outputs: deque[list[StepOutput]] = deque()
        self._buffered = 0
        self._cond = threading.Condition()
        self._silent: set[str] = set()
        self._stop = False
        self.pace_s = 0.0                 # deliver at most this often (module docstring); 0: every step
        self._undelivered = False         # outputs buffered since on_output last ran
        self._delivered_at = 0.0          # monotonic: when on_output last ran
        self._streaming: set[str] = set() # requests whose first token was delivered (not yet final)
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.steps = 0
        # load figures for the registry, refreshed after each step (plain ints: safe to read)
        self.running = 0
        self.waiting = 0
        self.kv_used = 0
        self.kv_total = engine.kv_tokens_total
        self.preemptions = 0
        # prefix cache hit rate (context tokens of admitted requests / of those taken from the cache)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # health: consecutive steps whose every output was an internal error (a poisoned CUDA
        # context fails every forward pass; the engine catches that and fails the step's
        # requests, so the thread itself stays alive and only its outputs tell)
        self.failed_steps = 0
        self.unhealthy_reason = ""
        # for the worker's metrics: one record a step, one a cancel (worker.telemetry)
        self.telemetry = Telemetry()
        self._telemetry_lock = threading.Lock()
        self._tokenizing: ThreadPoolExecutor | None = None   # tokenize requests (started on first use)
        # structured output: grammars compile on threads of their own; a finished one wakes the
        # loop, which steps only when the engine has something to do without waiting for one
        if hasattr(engine, "on_compiled"):
            engine.on_compiled(self._wake)

    # ---- called from the asyncio side -----------------------------------------------------

    def start(self, on_output: Callable[[], None] | None = None, pace_s: float = 0.0) -> None:
        """Start stepping. `on_output` (EngineClient.start), when given, runs on the calling
        event loop whenever outputs are ready; without it, the constructor's callback runs in
        the engine thread itself (the engine process's pipe link). `pace_s`: see the module."""
        self.pace_s = pace_s
        if on_output is not None:
            self._on_output = on_loop(asyncio.get_running_loop(), on_output)
        self._thread.start()

    def submit(self, command: Add | Cancel) -> None:
        with self._cond:
            self._inbox.append(command)
            self._cond.notify_all()

    def take_outputs(self) -> list[StepOutput]:
        """Everything buffered so far, in step order; unpauses the engine."""
        with self._cond:
            batches = list(self._outputs)
            self._outputs.clear()
            self._buffered = 0
            self._cond.notify_all()
        return [o for batch in batches for o in batch]

    def take_telemetry(self) -> Telemetry:
        with self._telemetry_lock:
            out = self.telemetry.take()
        if hasattr(self.engine, "take_grammar_records"):
            out.compiles, out.refusals = self.engine.take_grammar_records()
        return out

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _ready(self) -> bool:
        """The engine can step now without waiting (the synthetic engine: whenever it has work)."""
        ready = getattr(self.engine, "ready", None)
        return ready() if ready is not None else self.engine.has_work

    def _idle(self) -> bool:
        """Nothing to apply and nothing to step (called holding the lock)."""
        return not self._inbox and not self._ready()

    def _idle_wait_s(self) -> float:
        """How long the loop may sleep: until the next gauge sample or compile deadline."""
        deadline = getattr(self.engine, "compile_deadline", lambda: None)()
        return GAUGES_EVERY_S if deadline is None else max(0.0, min(GAUGES_EVERY_S, deadline - time.monotonic()))

    def tokenize_in_thread(self, request: dict) -> Future:
        """worker.tokenization.answer with the engine's tokenizer, on one thread of its own (not
        the engine's: its steps go on). Only reads the tokenizer, as the engine thread does."""
        if self._tokenizing is None:
            self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        return self._tokenizing.submit(answer, self.engine.tokenizer, request, getattr(self.engine, "max_model_len", 0))

    async def tokenize(self, request: dict) -> dict:
        return await asyncio.wrap_future(self.tokenize_in_thread(request))

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._tokenizing is not None:
            self._tokenizing.shutdown(wait=False, cancel_futures=True)
        self._thread.join(timeout)

    # ---- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._undelivered:
                with self._cond:
                    idle = self._idle()
                if idle:                  # nothing to step: what is held goes out before the wait
                    self._deliver()       # (outside the lock: the pipe link may wait for credit)
            with self._cond:
                while not self._stop and (self._buffered >= self.buffer_max or self._idle()):
                    self._cond.wait(self._idle_wait_s())
                    with self._telemetry_lock:     # idle: the gauges still follow (e.g. blocks now cached)
                        self.telemetry.sample_gauges(self.engine, time.monotonic())
                if self._stop:
                    return
                commands = list(self._inbox)
                self._inbox.clear()
            produced: list[StepOutput] = []
            for command in commands:
                try:
                    produced.extend(self._apply(command))
                except Exception:
                    log.exception("engine command %r failed", command)
            step_s = 0.0
            if self._ready():
                started = time.perf_counter()
                try:
                    produced.extend(self.engine.step())
                    self.steps += 1
                except Exception:  # the engine catches forward errors itself; this is a last resort
                    log.exception("engine step raised; failing its requests")
                    produced.extend(self._fail_all())
                step_s = time.perf_counter() - started
                step = getattr(self.engine, "last_step", None)
                if step is not None:
                    with self._telemetry_lock:
                        self.telemetry.record_step(*step, step_s)
            self._check_health(produced)
            produced = [o for o in produced if not self._swallow(o)]
            self.running, self.waiting = self.engine.num_running, self.engine.num_waiting
            self.kv_used = self.engine.kv_tokens_used
            self.preemptions = self.engine.preemptions
            self.prefix_cache_queries = getattr(self.engine, "prefix_cache_queries", 0)   # 0: the synthetic engine
            self.prefix_cache_hits = getattr(self.engine, "prefix_cache_hits", 0)
            with self._telemetry_lock:
                self.telemetry.sample_gauges(self.engine, time.monotonic())
            if produced:
                with self._cond:
                    self._outputs.append(produced)
                    self._buffered += len(produced)
                self._undelivered = True
            if self._undelivered and self._deliver_now(produced, step_s):
                self._deliver()
            # Hand the GIL to the asyncio thread between steps: a cancel that has arrived on the
            # control stream is then in the inbox before the next step, instead of waiting out
            # the interpreter's 5 ms switch interval while short steps run back to back.
            time.sleep(0)

    def _deliver_now(self, produced: list[StepOutput], step_s: float) -> bool:
        """Are the buffered outputs to be delivered after this step? (pacing: the module)"""
        urgent = False
        for o in produced:
            if o.finished:
                self._streaming.discard(o.rid)
                urgent = True
            elif o.token_ids and o.rid not in self._streaming:
                self._streaming.add(o.rid)
                urgent = True
        if urgent or self.pace_s <= 0 or 2 * self._buffered >= self.buffer_max:
            return True
        elapsed = time.monotonic() - self._delivered_at
        return elapsed >= self.pace_s or elapsed + step_s >= 2 * self.pace_s

    def _deliver(self) -> None:
        self._undelivered = False
        self._delivered_at = time.monotonic()
        self._on_output()

    def _check_health(self, produced: list[StepOutput]) -> None:
        if any(o.token_ids for o in produced):
            self.failed_steps = 0
            return
        failed = [o for o in produced if o.error_code == ErrorCode.INTERNAL]
        if not failed:
            return
        self.failed_steps += 1
        if self.failed_steps >= FAILED_STEPS_UNHEALTHY and not self.unhealthy_reason:
            self.unhealthy_reason = (f"{self.failed_steps} engine steps in a row failed: "
                                     f"{failed[-1].error_message or 'internal error'}")[:500]
            log.critical("engine unhealthy, taking no more work: %s", self.unhealthy_reason)

    def _apply(self, command: Add | Cancel) -> list[StepOutput]:
        if isinstance(command, Cancel):
            if self.engine.cancel(command.rid):       # its KV blocks are free now
                if command.silent:
                    self._silent.add(command.rid)
                    self._streaming.discard(command.rid)   # its final is swallowed, never seen here
                else:
                    with self._telemetry_lock:
                        self.telemetry.record_cancel(command.received_at)
            return []
        entry = command.entry
        try:
            ids = list(entry.prompt_ids) if entry.prompt_ids is not None else \
                build_prompt_ids(self.engine.tokenizer, entry.prompt, entry.messages, entry.tools)
        except Exception as exc:
            return [error_output(entry.rid, ErrorCode.INVALID_REQUEST, f"could not build the prompt: {exc}")]
        if len(ids) > self.max_prompt_tokens:
            return [error_output(entry.rid, ErrorCode.CONTEXT_TOO_LONG,
                                 f"prompt is {len(ids)} tokens, the limit is {self.max_prompt_tokens}", len(ids))]
        try:
            self.engine.add(EngineRequest(rid=entry.rid, prompt_ids=ids, params=entry.params,
                                          priority=entry.priority, generated_ids=list(command.generated_ids),
                                          ignore_eos=entry.params.ignore_eos, cache_salt=entry.cache_salt,
                                          prompt_text=entry.prompt))
        except EngineRejected as exc:
            return [error_output(entry.rid, exc.code, exc.message, len(ids), param=exc.param)]
        except Exception as exc:  # a bug or odd input must fail this request only
            log.exception("engine.add failed for %s", entry.rid, extra=rid_of(entry.rid))
            return [error_output(entry.rid, ErrorCode.INTERNAL, f"could not start the request: {exc}", len(ids))]
        return []

    def _swallow(self, out: StepOutput) -> bool:
        """Final outputs of silently dropped requests are not reported."""
        if out.rid in self._silent and out.finished:
            self._silent.discard(out.rid)
            return True
        return out.rid in self._silent

    def _fail_all(self) -> list[StepOutput]:
        outs = []
        for rid in self.engine.request_ids():
            self.engine.cancel(rid)
        for out in self.engine.step():
            outs.append(error_output(out.rid, ErrorCode.INTERNAL, "engine failure", out.prompt_tokens))
        return outs


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> Callable[[], None]:
    """A callback, safe to call from any thread, that runs `fn` on `loop`."""
    def notify() -> None:
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:  # loop closed during shutdown
            pass
    return notify
