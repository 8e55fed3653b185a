"""The engine in a child process of its own (vLLM v1's EngineCore split): an `EngineClient`
(worker.engine_client), as EngineThread is.

Why: the engine's host work (scheduling, preparing inputs, sampling, detokenizing: tens of µs a
row a step) and the service's Redis I/O (5-15 µs of Python a token in the output writer) shared
one GIL. At GPU pace (256 rows every few ms) the two together need more than one core of
Python, so one process could not keep the pace however fast the device. Here the child runs
the unchanged `EngineThread` around the engine; the parent (the asyncio service) sees the same
`submit` / `take_outputs` / load figures, and the two talk over a pipe in msgpack: one message
per command and one per step's outputs (keyed columns, worker.engine_wire), sent by the engine
thread itself right after the step
and read by the parent's event loop (no thread on either side whose only job is the pipe, so
no GIL hand-offs per step; ~1 µs a row in all, against the GIL time it frees).

Backpressure crosses the pipe as credit: the engine thread sends a step's outputs only while
the parent holds fewer than `buffer_max` of them untaken, and otherwise waits (the engine
pauses), so a stalled writer (Redis down) still bounds memory, as in one process. The child
dies with the parent (PR_SET_PDEATHSIG, and EOF on the pipe): an engine must never outlive the
worker that owns its requests, or hold a GPU after it. The child ignores SIGINT/SIGTERM: the parent drains first and
then stops it.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Callable

import msgpack

from shared.errors import ErrorCode
from shared.logs import configure
from shared.streams import RequestEntry
from worker.engine import StepOutput
from worker.engine_client import Add, Cancel, EngineClient
from worker.engine_thread import EngineThread
from worker.engine_wire import pack_outputs, unpack_outputs
from worker.telemetry import Telemetry
from worker.tokenization import refusal

log = logging.getLogger("worker.engine")

STATUS_EVERY_S = 0.5      # load figures go to the parent at least this often while idle
START_TIMEOUT_S = 1800.0  # loading a large model from a slow disk


class EngineStartFailed(RuntimeError):
    pass


# ---- load figures -------------------------------------------------------------------------

def _status(t: EngineThread) -> list:
    return [t.running, t.waiting, t.kv_used, t.preemptions, t.steps, t.failed_steps, t.unhealthy_reason,
            t.prefix_cache_queries, t.prefix_cache_hits]


def build_model_engine(settings) -> object:
    """The production engine from settings (the model loaded here: in the child, by default)."""
    from worker.engine import Engine, EngineConfig, load_model
    model, tokenizer = load_model(settings)
    return Engine(model, tokenizer, EngineConfig.from_settings(settings))


def start_engine(build: Callable[[], object], settings) -> EngineClient:
    """The engine client the worker service runs: the engine launched in its own process
    (ENGINE_PROCESS, the default; `build` runs there), or built here and run in a thread of
    this process."""
    if not settings.engine_process:
        return EngineThread(build(), max_prompt_tokens=settings.max_prompt_tokens, buffer_max=settings.output_buffer_max)
    proc = EngineProcess(build, max_prompt_tokens=settings.max_prompt_tokens, buffer_max=settings.output_buffer_max)
    proc.launch()
    return proc


# ---- the parent's side ---------------------------------------------------------------------

class EngineProcess:
    """An EngineClient whose engine runs in a child process; `start` must run on the event loop
    that takes the outputs (it reads the pipe there)."""

    MESSAGES_PER_WAKE = 16   # then the loop runs other callbacks before reading on

    def __init__(self, build: Callable[[], object], *, max_prompt_tokens: int, buffer_max: int):
        self._build = build          # picklable: runs in the child (spawned, so CUDA can start there)
        self.max_prompt_tokens = max_prompt_tokens
        self.buffer_max = buffer_max
        self._on_output: Callable[[], None] = lambda: None
        self._outputs: list[StepOutput] = []
        self._conn: Connection | None = None
        self._proc = None
        self._loop = None
        self._gone = False          # EOF on the pipe: the child exited
        self._stopping = False
        self.running = self.waiting = self.kv_used = self.kv_total = 0
        self.preemptions = self.steps = self.failed_steps = 0
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.unhealthy_reason = ""
        self._telemetry = Telemetry()
        self._tokenize_replies: dict[int, asyncio.Future] = {}   # tokenize requests the child is answering
        self._tokenize_seq = 0

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

    def start(self, on_output: Callable[[], None], pace_s: float = 0.0) -> None:
        """Deliver outputs from now on; `on_output` runs on this loop when some arrived (the
        child's engine thread paces them: EngineThread.pace_s)."""
        self._on_output = on_output
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._conn.fileno(), self._read)
        self._send(["pace", pace_s])

    def submit(self, command: Add | Cancel) -> None:
        if isinstance(command, Add):
            self._send(["add", command.entry.encode(), command.generated_ids])
        else:
            self._send(["cancel", command.rid, command.silent, command.received_at])

    def take_outputs(self) -> list[StepOutput]:
        """Everything received so far, in step order; returns the credit to the child."""
        outs, self._outputs = self._outputs, []
        if outs:
            self._send(["took", len(outs)])
        return outs

    def take_telemetry(self) -> Telemetry:
        return self._telemetry.take()

    async def tokenize(self, request: dict) -> dict:
        """Answered by the child's tokenize thread (EngineThread.tokenize_in_thread)."""
        if self._gone or self._loop is None:
            return refusal(ErrorCode.INTERNAL, "the engine process is gone")
        self._tokenize_seq += 1
        n = self._tokenize_seq
        self._tokenize_replies[n] = reply = self._loop.create_future()
        try:
            self._send(["tok", n, request])
            return await reply
        finally:
            self._tokenize_replies.pop(n, None)

    def is_alive(self) -> bool:
        return bool(self._proc and not self._gone and self._proc.is_alive())

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the child (after the drain: outputs still in flight are discarded, read only so
        that an engine thread blocked on a full pipe can see the stop)."""
        self._stopping = True
        self._send(["stop"])
        if self._proc:
            deadline = time.monotonic() + timeout
            while self._proc.is_alive() and time.monotonic() < deadline:
                try:
                    if self._conn is not None and self._conn.poll(0.05):
                        self._conn.recv_bytes()
                except (EOFError, OSError):
                    self._proc.join(max(0.0, deadline - time.monotonic()))
                    break
            if self._proc.is_alive():
                log.warning("engine process did not stop within %.0f s; killing it", timeout)
                self._proc.kill()
                self._proc.join(5)
        self._close()

    def _send(self, message: list) -> None:
        if self._gone or self._conn is None:
            return
        try:
            self._conn.send_bytes(msgpack.packb(message))
        except OSError:       # the child is gone: is_alive() says so, the lifecycle acts on it
            pass

    def _read(self) -> None:
        """Readable pipe: handle what arrived (a bounded number of messages per wake)."""
        conn, got = self._conn, False
        try:
            for _ in range(self.MESSAGES_PER_WAKE):
                kind, *rest = msgpack.unpackb(conn.recv_bytes())
                if kind == "tokr":
                    reply = self._tokenize_replies.get(rest[0])
                    if reply is not None and not reply.done():
                        reply.set_result(rest[1])
                else:
                    self._apply_status(rest[-2])
                    self._telemetry.merge(Telemetry.unpack(rest[-1]))
                if kind == "out":
                    self._outputs.extend(unpack_outputs(rest[0]))
                    got = True
                if not conn.poll():
                    break
        except (EOFError, OSError):
            if not self._stopping:
                log.critical("the engine process is gone (exit code %s)", self._proc.exitcode if self._proc else None)
            self._close()
            got = True
        if got:
            self._on_output()

    def _close(self) -> None:
        self._gone = True
        for reply in self._tokenize_replies.values():
            if not reply.done():
                reply.set_result(refusal(ErrorCode.INTERNAL, "the engine process is gone"))
        if self._conn is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._conn.fileno())
            self._conn.close()
            self._conn = None

    def _apply_status(self, s: list) -> None:
        (self.running, self.waiting, self.kv_used, self.preemptions, self.steps, self.failed_steps,
         self.unhealthy_reason, self.prefix_cache_queries, self.prefix_cache_hits) = s


# ---- the child's side ----------------------------------------------------------------------

def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):    # not Linux: EOF on the pipe still ends the child
        pass
    if os.getppid() == 1:                # the parent died before prctl took effect
        os._exit(1)


class _ChildLink:
    """The child's end: the engine thread sends each step's outputs (waiting for credit), the
    main thread receives commands and credit and sends the load figures when nothing else did."""

    def __init__(self, conn: Connection, buffer_max: int):
        self.conn = conn
        self.buffer_max = buffer_max
        self.thread: EngineThread | None = None
        self._send_lock = threading.Lock()
        self._credit = threading.Condition()
        self._outstanding = 0
        self._stop = False
        self.last_status = 0.0

    def send(self, message: list) -> None:
        data = msgpack.packb(message)
        with self._send_lock:
            try:
                self.conn.send_bytes(data)
            except OSError:           # the parent is gone: nothing to serve any more
                os._exit(0)
        if message[0] not in ("ready", "tokr"):    # these carry no load figures
            self.last_status = time.monotonic()

    def on_output(self) -> None:
        """In the engine thread, after a step that produced outputs."""
        outs = self.thread.take_outputs()
        if not outs:
            return
        with self._credit:
            self._credit.wait_for(lambda: self._outstanding < self.buffer_max or self._stop)
            if self._stop:
                return
            self._outstanding += len(outs)
        self.send(["out", pack_outputs(outs), _status(self.thread), self.thread.take_telemetry().pack()])

    def took(self, n: int) -> None:
        with self._credit:
            self._outstanding -= n
            self._credit.notify_all()

    def stop(self) -> None:
        with self._credit:
            self._stop = True
            self._credit.notify_all()


def _child_main(build: Callable[[], object], conn: Connection, max_prompt_tokens: int, buffer_max: int) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure("engine")
    link = _ChildLink(conn, buffer_max)
    try:
        engine = build()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which exits with it
        log.exception("building the engine failed")
        link.send(["failed", f"{type(exc).__name__}: {exc}"[:2000]])
        return
    link.thread = thread = EngineThread(engine, max_prompt_tokens=max_prompt_tokens, buffer_max=buffer_max,
                                        on_output=link.on_output)
    link.send(["ready", thread.kv_total])
    thread.start()
    code = 1
    try:
        code = _serve_commands(conn, thread, link)
    finally:
        link.stop()
        thread.stop()
    # a normal exit through multiprocessing's bootstrap, which runs its finalizers: semaphores
    # that libraries created here (tqdm's lock while loading) are released, not reported leaked
    sys.exit(code)


def _serve_commands(conn: Connection, thread: EngineThread, link: _ChildLink) -> int:
    """Commands and credit from the parent until it says stop or goes away; the load figures
    every STATUS_EVERY_S that no output carried them. Returns the child's exit code."""
    while True:
        if conn.poll(STATUS_EVERY_S):
            try:
                kind, *rest = msgpack.unpackb(conn.recv_bytes())
            except (EOFError, OSError):      # the parent is gone
                return 0
            if kind == "add":
                thread.submit(Add(RequestEntry.decode(rest[0]), generated_ids=list(rest[1])))
            elif kind == "cancel":
                thread.submit(Cancel(rest[0], silent=rest[1], received_at=rest[2]))
            elif kind == "took":
                link.took(rest[0])
            elif kind == "pace":
                thread.pace_s = rest[0]
            elif kind == "tok":
                thread.tokenize_in_thread(rest[1]).add_done_callback(
                    lambda done, n=rest[0]: link.send(["tokr", n, done.result() if not done.cancelled() else
                                                       refusal(ErrorCode.INTERNAL, "the engine is stopping")]))
            else:
                return 0
        if not thread.is_alive():
            log.critical("the engine thread died")
            return 1
        if time.monotonic() - link.last_status >= STATUS_EVERY_S:
            link.send(["status", _status(thread), thread.take_telemetry().pack()])
