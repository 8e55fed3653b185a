"""Compiling structured-output grammars off the engine thread, within limits.

Why: xgrammar compiles an ordinary JSON schema in milliseconds, but a counted repetition
(`minLength: 10000`, `maxLength: 1000`) costs ~1-5 s each and a crafted schema with several
takes minutes. Compiled inside the engine thread, that froze every stream of the worker for as
long. Here a request with a grammar waits in `CompilePool` until its matcher is ready and only
then joins the batch (`Engine.add` / `Engine.step`); the batch never waits for a compile.

Why a thread pool and not processes: xgrammar releases the GIL while it compiles (its bindings
wrap the compile in a GIL release; measured in bench/grammar_compile.py: the engine thread's
Python keeps running while a 1-2 s compile runs beside it). A process could be killed at the
timeout, but each would import xgrammar (and torch) anew (5-7 s, ~270 MB) and send every
compiled grammar back as ~1 MB of JSON to deserialize.

What a thread cannot do is stop: a compile past its deadline refuses its request then
(`timeout`), but xgrammar runs on to the end and its result lands in the cache (a retry of the
same schema is then served at once). The pool is bounded (`threads`): crafted schemas can at
worst hold every compile thread, so that this worker's other structured requests wait and are
refused at their deadline; plain requests never wait for a compile.

Limits (`GrammarLimits`, from GRAMMAR_* settings, docs/operations.md): the schema's size in bytes
(compact JSON), the compile time, the compiled-grammar cache's bytes (xgrammar's own cache, keyed
by the schema text; before it was unbounded). A refusal (`GrammarRefused`: `too_large`,
`timeout`, `invalid`) ends its request with `invalid_request` naming the field the schema came
from (`response_format`, or `tools` for a forced tool call's schema).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Callable

REASONS = ("too_large", "timeout", "invalid")
SEPARATORS = (", ", ": ")
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class GrammarLimits:
    max_schema_bytes: int = 64 * 1024      # the schema as compact JSON
    compile_timeout_s: float = 10.0        # submit -> matcher ready, queueing included
    cache_bytes: int = 64 * 1024 * 1024    # compiled grammars kept (xgrammar's cache); -1: unbounded
    threads: int = 2                       # compiles at once (and xgrammar's threads per compile)

    def __post_init__(self):
        if self.max_schema_bytes < 1 or self.compile_timeout_s <= 0 or self.threads < 1 or self.cache_bytes < -1:
            raise ValueError(f"invalid grammar limits: {self}")

    @classmethod
    def from_settings(cls, settings) -> "GrammarLimits":
        return cls(max_schema_bytes=settings.grammar_max_schema_bytes,
                   compile_timeout_s=settings.grammar_compile_timeout_s,
                   cache_bytes=settings.grammar_cache_bytes, threads=settings.grammar_compile_threads)


class GrammarError(ValueError):
    """A grammar spec that cannot be compiled (the request is refused, `invalid_request`)."""


class GrammarRefused(GrammarError):
    """A request's grammar refused: `reason` is one of REASONS, `param` the request field."""

    def __init__(self, reason: str, message: str, param: str):
        super().__init__(message)
        self.reason, self.param = reason, param


def spec_param(spec) -> str:
    """The request field a grammar spec came from (shared.structured.grammar_for marks a forced
    tool call's `tools`; older gateways mark nothing: `response_format`)."""
    param = spec.get("param") if isinstance(spec, dict) else None
    return param if param in ("response_format", "tools") else "response_format"


def schema_text(spec, max_bytes: int) -> str:
    """The schema of a spec as compact JSON (xgrammar's input and its cache key), or GrammarRefused."""
    param = spec_param(spec)
    if not isinstance(spec, dict):
        raise GrammarRefused("invalid", "a grammar spec is an object", param)
    kind = spec.get("type")
    if kind == "json_object":
        schema = ANY_OBJECT
    elif kind == "json_schema":
        schema = spec.get("schema")
        if not isinstance(schema, (dict, bool)):
            raise GrammarRefused("invalid", "json_schema needs a 'schema' object", param)
    else:
        raise GrammarRefused("invalid", f"unknown grammar type {kind!r}", param)
    try:
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise GrammarRefused("invalid", f"the JSON schema cannot be used: {exc}", param) from None
    size = len(text.encode())
    if size > max_bytes:
        raise GrammarRefused("too_large", f"the JSON schema is {size} bytes, the limit is {max_bytes} "
                                          "(GRAMMAR_MAX_SCHEMA_BYTES)", param)
    return text


class Compile:
    """One request's grammar on its way: ready once compiled (a matcher or a refusal) or once
    its deadline has passed (a `timeout` refusal)."""

    __slots__ = ("future", "deadline", "param", "timeout_s", "started")

    def __init__(self, future: Future, deadline: float, param: str, timeout_s: float, started: threading.Event):
        self.future, self.deadline, self.param, self.timeout_s = future, deadline, param, timeout_s
        self.started = started      # set when a compile thread took it (tests wait on it)

    def ready(self, now: float) -> bool:
        return self.future.done() or now >= self.deadline

    def result(self, now: float):
        """The request's matcher, or GrammarRefused; call once `ready`."""
        if self.future.done():
            return self.future.result()
        raise GrammarRefused("timeout", f"compiling the JSON schema took longer than {self.timeout_s:g} s "
                                        "(GRAMMAR_COMPILE_TIMEOUT_S)", self.param)

    def abandon(self) -> None:
        """Its request went away: a compile not yet started never starts (one running finishes)."""
        self.future.cancel()


class Waiting:
    """The engine's requests waiting for their grammar, each with its `Compile` (arrival order)."""

    def __init__(self):
        self._jobs: dict[str, tuple[object, Compile]] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, rid: str) -> bool:
        return rid in self._jobs

    def rids(self) -> list[str]:
        return list(self._jobs)

    def add(self, rid: str, req, job: Compile) -> None:
        self._jobs[rid] = (req, job)

    def get(self, rid: str) -> Compile | None:
        waiting = self._jobs.get(rid)
        return waiting[1] if waiting else None

    def drop(self, rid: str):
        """The request leaves before its grammar is ready (its compile abandoned); None if not here."""
        req, job = self._jobs.pop(rid, (None, None))
        if job is not None:
            job.abandon()
        return req

    def any_ready(self) -> bool:
        now = time.monotonic()
        return any(job.ready(now) for _, job in self._jobs.values())

    def deadline(self) -> float | None:
        """time.monotonic() by which the next compile is refused if not done (None: none waits)."""
        return min((job.deadline for _, job in self._jobs.values()), default=None)

    def take_ready(self) -> list[tuple[object, Compile, float]]:
        """The requests whose compile ended or whose deadline passed: (request, compile, now)."""
        now = time.monotonic()
        ready = [(rid, req, job) for rid, (req, job) in self._jobs.items() if job.ready(now)]
        for rid, _, _ in ready:
            del self._jobs[rid]
        return [(req, job, now) for _, req, job in ready]

    def wait(self) -> None:
        """Block until a compile ends or the next deadline passes."""
        if self._jobs:
            wait([job.future for _, job in self._jobs.values()], timeout=max(0.0, self.deadline() - time.monotonic()),
                 return_when=FIRST_COMPLETED)


class CompilePool:
    """Compiles grammar specs on `limits.threads` threads. `build()` makes the xgrammar compiler
    (the tokenizer's token table, ~0.1-0.4 s) on the first compile, in a pool thread; `matcher(
    compiled)` turns a compiled grammar into a request's matcher. Records each compile's seconds and
    each refusal's reason for the worker's metrics (`take_records`). Its threads run at a lower
    CPU priority (`NICE`, Linux: per thread, inherited by xgrammar's own threads): on a busy CPU
    the engine's step comes first and the compile takes what is left."""

    NICE = 10

    def __init__(self, build: Callable[[int, int], object], matcher: Callable[[object], object], limits: GrammarLimits):
        self.limits = limits
        self._build, self._matcher = build, matcher
        self._compiler = None
        self._build_lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._records_lock = threading.Lock()
        self._durations: list[float] = []
        self._refusals: list[str] = []
        self.on_done: Callable[[], None] = lambda: None   # called in a compile thread after each compile

    def submit(self, spec) -> Compile:
        """Start compiling `spec` for a request; never blocks."""
        if not self._threads:
            # daemon threads: a compile that cannot be stopped must not hold up the process's exit
            self._threads = [threading.Thread(target=self._serve, name=f"grammar-{i}", daemon=True)
                             for i in range(self.limits.threads)]
            for thread in self._threads:
                thread.start()
        started = threading.Event()
        future: Future = Future()
        future.add_done_callback(lambda _: self.on_done())
        self._queue.put((future, spec, started))
        timeout = self.limits.compile_timeout_s
        return Compile(future, time.monotonic() + timeout, spec_param(spec), timeout, started)

    def _serve(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                           min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + self.NICE))
        except (AttributeError, OSError):    # not Linux, or not allowed: the default priority
            pass
        while (item := self._queue.get()) is not None:
            future, spec, started = item
            if not future.set_running_or_notify_cancel():    # abandoned while queued
                continue
            try:
                future.set_result(self._run(spec, started))
            except BaseException as exc:  # noqa: BLE001 - GrammarRefused, or a bug: the request's to report
                future.set_exception(exc)

    def compile_now(self, spec):
        """A matcher for `spec` compiled in the calling thread (tests, benchmarks), or GrammarRefused."""
        return self._run(spec, threading.Event())

    def _run(self, spec, started: threading.Event):
        started.set()
        text = schema_text(spec, self.limits.max_schema_bytes)
        compiler = self._get_compiler()
        t0 = time.perf_counter()
        try:
            compiled = compiler.compile_json_schema(text, any_whitespace=False, separators=SEPARATORS,
                                                    strict_mode=True)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarRefused("invalid", f"the JSON schema cannot be used: {_first_line(exc)}",
                                 spec_param(spec)) from None
        finally:
            with self._records_lock:
                self._durations.append(time.perf_counter() - t0)
        return self._matcher(compiled)

    def compiler(self):
        """xgrammar's compiler for this engine's tokenizer (built on first use)."""
        return self._get_compiler()

    def _get_compiler(self):
        with self._build_lock:
            if self._compiler is None:
                self._compiler = self._build(self.limits.threads, self.limits.cache_bytes)
            return self._compiler

    def count_refusal(self, reason: str) -> None:
        with self._records_lock:
            self._refusals.append(reason)

    def take_records(self) -> tuple[list[float], list[str]]:
        """(compile seconds, refusal reasons) since the last take."""
        with self._records_lock:
            out = (self._durations, self._refusals)
            self._durations, self._refusals = [], []
        return out

    def shutdown(self) -> None:
        for _ in self._threads:
            self._queue.put(None)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    # xgrammar prefixes "[time] /path/file.cc:line: "; keep the message
    return line.split(": ", 1)[1] if line.startswith("[") and ": " in line else line
