"""The engine in a child process of its own (vLLM v1's EngineCore split), behind EngineThread's API.

Why: the engine's host work (scheduling, preparing inputs, sampling, detokenizing: tens of µs a
row a step) and the service's Redis I/O (~15 µs of Python a token in the output writer) shared
one GIL. At GPU pace (256 rows every few ms) the two together need more than one core of
Python, so one process could not keep the pace however fast the device. Here the child runs
the unchanged `EngineThread` around the engine; the parent (the asyncio service) sees the same
`submit` / `take_outputs` / load figures, and the two talk over a pipe in msgpack: one message
per command and one per step's outputs (a few µs a row, against the GIL time it frees).

Backpressure crosses the pipe as credit: the child sends outputs only while the parent holds
fewer than `buffer_max` of them untaken, so a stalled writer (Redis down) still pauses the
engine at a bounded buffer, as in one process. The child dies with the parent
(PR_SET_PDEATHSIG, and EOF on the pipe): an engine must never outlive the worker that owns its
requests, or hold a GPU after it. The child ignores SIGINT/SIGTERM: the parent drains first and
then stops it.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Callable

import msgpack

from shared.errors import ErrorCode
from shared.streams import RequestEntry
from worker.engine import StepOutput
from worker.engine_thread import Add, Cancel, EngineThread

log = logging.getLogger("worker.engine")

STATUS_EVERY_S = 0.5      # load figures go to the parent at least this often while idle
START_TIMEOUT_S = 1800.0  # loading a large model from a slow disk


class EngineStartFailed(RuntimeError):
    pass


# ---- wire format (positional msgpack lists) ------------------------------------------------

def _pack_output(o: StepOutput) -> list:
    return [o.rid, o.text, o.token_ids, o.finished, o.finish_reason, o.prompt_tokens, o.completion_tokens,
            o.error_code.value if o.error_code is not None else None, o.error_message, o.emitted_ms]


def _unpack_output(f: list) -> StepOutput:
    return StepOutput(rid=f[0], text=f[1], token_ids=f[2], finished=f[3], finish_reason=f[4], prompt_tokens=f[5],
                      completion_tokens=f[6], error_code=ErrorCode(f[7]) if f[7] is not None else None,
                      error_message=f[8], emitted_ms=f[9])


def _status(t: EngineThread) -> list:
    return [t.running, t.waiting, t.kv_used, t.preemptions, t.steps, t.failed_steps, t.unhealthy_reason]


def build_model_engine(settings) -> object:
    """The production engine from settings (the model loaded here: in the child, by default)."""
    from worker.engine import Engine, EngineConfig, load_model
    model, tokenizer = load_model(settings)
    return Engine(model, tokenizer, EngineConfig.from_settings(settings))


def start_engine(build: Callable[[], object], settings) -> object:
    """The engine the worker service runs: launched in its own process (ENGINE_PROCESS, the
    default) or built here for a thread of this process."""
    if not settings.engine_process:
        return build()
    proc = EngineProcess(build, max_prompt_tokens=settings.max_prompt_tokens, buffer_max=settings.output_buffer_max)
    proc.launch()
    return proc


# ---- the parent's side ---------------------------------------------------------------------

class EngineProcess:
    """Same surface as EngineThread (submit, take_outputs, is_alive, stop, load figures)."""

    def __init__(self, build: Callable[[], object], *, max_prompt_tokens: int, buffer_max: int):
        self._build = build          # picklable: runs in the child (spawned, so CUDA can start there)
        self.max_prompt_tokens = max_prompt_tokens
        self.buffer_max = buffer_max
        self._on_output: Callable[[], None] = lambda: None
        self._outputs: deque[StepOutput] = deque()
        self._lock = threading.Lock()       # guards _outputs and sends on the pipe
        self._conn: Connection | None = None
        self._proc = None
        self._reader: threading.Thread | None = None
        self._closed = False
        self._stopping = False
        self.running = self.waiting = self.kv_used = self.kv_total = 0
        self.preemptions = self.steps = self.failed_steps = 0
        self.unhealthy_reason = ""

    def launch(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start the child and wait until its engine is built (the model loaded)."""
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_child_main, name="engine",
                                 args=(self._build, child, self.max_prompt_tokens, self.buffer_max), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        deadline = time.monotonic() + timeout
        while not parent.poll(0.5):
            if not self._proc.is_alive():
                raise EngineStartFailed(f"the engine process exited with {self._proc.exitcode} while starting")
            if time.monotonic() > deadline:
                self._proc.kill()
                raise EngineStartFailed(f"the engine process was not ready within {timeout:.0f} s")
        try:
            kind, payload = msgpack.unpackb(parent.recv_bytes())
        except EOFError:
            raise EngineStartFailed("the engine process exited while starting") from None
        if kind != "ready":
            raise EngineStartFailed(f"building the engine failed: {payload}")
        self.kv_total = payload
        log.info("engine process %d ready", self._proc.pid)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self, on_output: Callable[[], None]) -> None:
        self._on_output = on_output
        self._reader = threading.Thread(target=self._read, name="engine-pipe", daemon=True)
        self._reader.start()

    def submit(self, command: Add | Cancel) -> None:
        if isinstance(command, Add):
            self._send(["add", command.entry.encode(), command.generated_ids])
        else:
            self._send(["cancel", command.rid, command.silent])

    def take_outputs(self) -> list[StepOutput]:
        """Everything received so far, in step order; returns the credit to the child."""
        with self._lock:
            outs = list(self._outputs)
            self._outputs.clear()
        if outs:
            self._send(["took", len(outs)])
        return outs

    def is_alive(self) -> bool:
        return bool(self._proc and self._proc.is_alive() and self._reader and self._reader.is_alive())

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._send(["stop"])
        if self._proc:
            self._proc.join(timeout)
            if self._proc.is_alive():
                log.warning("engine process did not stop within %.0f s; killing it", timeout)
                self._proc.kill()
                self._proc.join(5)
        self._closed = True
        if self._conn:
            self._conn.close()

    def _send(self, message: list) -> None:
        data = msgpack.packb(message)
        with self._lock:
            if self._closed or self._conn is None:
                return
            try:
                self._conn.send_bytes(data)
            except OSError:       # the child is gone: is_alive() says so, the lifecycle acts on it
                pass

    def _read(self) -> None:
        conn = self._conn
        while True:
            try:
                kind, *rest = msgpack.unpackb(conn.recv_bytes())
            except (EOFError, OSError):
                if not self._stopping:
                    log.critical("the engine process is gone (exit code %s)", self._proc.exitcode if self._proc else None)
                self._on_output()
                return
            self._apply_status(rest[-1])
            if kind == "out":
                outs = [_unpack_output(f) for f in rest[0]]
                with self._lock:
                    self._outputs.extend(outs)
                self._on_output()

    def _apply_status(self, s: list) -> None:
        (self.running, self.waiting, self.kv_used, self.preemptions, self.steps, self.failed_steps,
         self.unhealthy_reason) = s


# ---- the child's side ----------------------------------------------------------------------

def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):    # not Linux: EOF on the pipe still ends the child
        pass
    if os.getppid() == 1:                # the parent died before prctl took effect
        os._exit(1)


def _child_main(build: Callable[[], object], conn: Connection, max_prompt_tokens: int, buffer_max: int) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    try:
        engine = build()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which exits with it
        log.exception("building the engine failed")
        conn.send_bytes(msgpack.packb(["failed", f"{type(exc).__name__}: {exc}"[:2000]]))
        return
    wake = threading.Condition()
    state = {"outstanding": 0, "stop": False}

    def notify() -> None:
        with wake:
            wake.notify()

    thread = EngineThread(engine, max_prompt_tokens=max_prompt_tokens, buffer_max=buffer_max, on_output=notify)
    conn.send_bytes(msgpack.packb(["ready", thread.kv_total]))
    thread.start()
    receiver = threading.Thread(target=_receive, args=(conn, thread, wake, state), name="engine-commands",
                                daemon=True)
    receiver.start()
    code = 1
    try:
        code = _send_outputs(conn, thread, wake, state, buffer_max)
    finally:
        thread.stop()
        sys.stdout.flush()
        os._exit(code)  # daemon threads and the engine's native pools: nothing left to flush


def _receive(conn: Connection, thread: EngineThread, wake: threading.Condition, state: dict) -> None:
    while True:
        try:
            kind, *rest = msgpack.unpackb(conn.recv_bytes())
        except (EOFError, OSError):  # the parent is gone
            kind, rest = "stop", []
        if kind == "add":
            thread.submit(Add(RequestEntry.decode(rest[0]), generated_ids=list(rest[1])))
        elif kind == "cancel":
            thread.submit(Cancel(rest[0], silent=rest[1]))
        else:
            with wake:
                if kind == "took":
                    state["outstanding"] -= rest[0]
                else:
                    state["stop"] = True
                wake.notify()
            if kind == "stop":
                return


def _send_outputs(conn: Connection, thread: EngineThread, wake: threading.Condition, state: dict,
                  buffer_max: int) -> int:
    """Forward the engine thread's outputs while the parent has credit; the load figures ride
    along, and go alone every STATUS_EVERY_S. Returns the child's exit code."""
    last_status = 0.0
    while True:
        with wake:
            wake.wait_for(lambda: state["stop"] or (state["outstanding"] < buffer_max and thread.has_outputs()),
                          STATUS_EVERY_S)
            if state["stop"]:
                return 0
            credit = state["outstanding"] < buffer_max
        outs = thread.take_outputs() if credit else []
        try:
            if outs:
                with wake:
                    state["outstanding"] += len(outs)
                conn.send_bytes(msgpack.packb(["out", [_pack_output(o) for o in outs], _status(thread)]))
                last_status = time.monotonic()
            elif time.monotonic() - last_status >= STATUS_EVERY_S:
                conn.send_bytes(msgpack.packb(["status", _status(thread)]))
                last_status = time.monotonic()
        except OSError:          # the parent is gone
            return 0
        if not thread.is_alive():
            log.critical("the engine thread died")
            return 1
