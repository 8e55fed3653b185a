"""What the worker service needs of an engine, whichever way the engine runs.

Why its own module: the service talks to one interface and never asks which implementation it
has (vLLM v1's `EngineCoreClient`: `InprocClient`, `MPClient`). Two implement it:

* worker.engine_thread.EngineThread — the engine in a thread of this process (ENGINE_PROCESS=false);
* worker.engine_process.EngineProcess — that thread in a child process of its own (the default).

The commands an engine client takes (`Add`, `Cancel`) are defined here, with the interface.
`worker.engine_process.start_engine` builds whichever the settings ask for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from shared.streams import RequestEntry
from worker.engine import StepOutput
from worker.telemetry import Telemetry


@dataclass
class Add:
    entry: RequestEntry
    generated_ids: list[int] = field(default_factory=list)  # continuation: tokens an earlier run delivered


@dataclass
class Cancel:
    rid: str
    silent: bool = False  # drop without a final output (the request was handed to another worker)
    received_at: float = 0.0  # time.time() when the worker received it (the cancel-latency metric)


class EngineClient(Protocol):
    """An engine that runs beside the service's event loop. Commands are applied at the next
    step boundary; outputs are buffered (bounded: the engine pauses while `take_outputs` is not
    called) until taken."""

    # load figures, refreshed after every step (plain values, safe to read at any time)
    running: int
    waiting: int
    kv_used: int
    kv_total: int
    preemptions: int
    steps: int
    prefix_cache_queries: int   # prompt tokens looked up in the prefix cache (total)
    prefix_cache_hits: int      # of those, served from it
    unhealthy_reason: str    # why every step fails ("" while the engine can serve)

    def start(self, on_output: Callable[[], None], pace_s: float = 0.0) -> None:
        """Start delivering outputs. Called on the event loop that takes them; `on_output` is
        then called on that loop whenever outputs are ready to take: after every step, or with
        `pace_s` > 0 at most that often, except a request's first token and its final, which
        are ready at once (EngineThread.pace_s)."""

    def submit(self, command: Add | Cancel) -> None:
        """Queue a command for the next step boundary (never blocks)."""

    def take_outputs(self) -> list[StepOutput]:
        """Everything produced so far, in step order; makes room for more."""

    async def tokenize(self, request: dict) -> dict:
        """A gateway's tokenize or detokenize request answered with the engine's tokenizer
        (worker.tokenization.answer), on a thread of its own: the step loop is not held up."""

    def take_telemetry(self) -> Telemetry:
        """The engine's step and cancel records since the last take, and its latest gauges
        (worker.metrics reads them a few times a second)."""

    def is_alive(self) -> bool:
        """False once the engine is gone (its thread or process died, or it was stopped)."""

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine (after the drain: outputs not yet taken are discarded)."""
