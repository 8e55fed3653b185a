"""Control entries for this worker (`p:{w:<id>}:ctl`): cancel, take, attach and tokenize.

Why its own module: a gateway reaches the worker that owns a request only through this stream
(the owner is in meta), and each message kind has one handler here.

* cancel: goes straight into the engine inbox, effective at the next step boundary;
* take (routing): another worker handed us a request entry routed here; it is in our pending
  list, intake runs it (worker.intake.Intake.take_forwarded);
* attach (a client resumed on gateway `gw`): the request's live events are routed to `gw`'s
  inbox from now on; the writer flushes what it has, then sends the attach marker "everything
  <= S is in history" (worker.output_writer.OutputWriter.attach). For a request this worker
  does not hold, the marker says `seq: null` (read the history to its end).
* tokenize / detokenize (vLLM's /tokenize, /detokenize on any gateway): answered by the engine
  client's tokenizer thread (worker.tokenization), the answer appended to gateway `gw`'s inbox
  as a `tokr` event; each in a task of its own, so a long prompt never delays a cancel, and at
  most MAX_TOKENIZING at once (more are refused as `overloaded`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import msgpack

from redis.exceptions import RedisError

from shared.errors import ErrorCode
from shared.events import TokenizeReply
from shared.streams import ENTRY_FIELD, TOKENIZE_KINDS, Keys, as_str
from worker.engine_client import Cancel, EngineClient
from worker.inflight import InFlightTable
from worker.output_writer import OutputWriter
from worker.redis_io import with_backoff
from worker.tokenization import refusal

log = logging.getLogger("worker.control")

BLOCK_MS = 1000
MAX_TOKENIZING = 16      # tokenize requests answered at once
TOKENIZE_TIMEOUT_S = 30.0


class Control:
    def __init__(self, *, blocking_redis, keys: Keys, worker_id: str, table: InFlightTable, engine: EngineClient,
                 writer: OutputWriter, on_take: Callable[[str, int], Awaitable[None]]):
        self.blocking_redis = blocking_redis     # XREAD ... BLOCK only
        self.keys = keys
        self.worker_id = worker_id
        self.table = table
        self.engine = engine
        self.writer = writer
        self.on_take = on_take                   # a routed entry handed to us (worker.intake)
        self.tokenizing: set[asyncio.Task] = set()

    async def loop(self) -> None:
        key = self.keys.ctl(self.worker_id)
        # An explicit id, not "$": with "$" every XREAD that times out would restart from the
        # then-newest entry, dropping a message that lands between two calls.
        last_id = f"{int(time.time() * 1000)}-0"
        try:
            while True:
                resp = await with_backoff(lambda: self.blocking_redis.xread({key: last_id}, count=256,
                                                                            block=BLOCK_MS), "read control")
                for _stream, entries in resp or []:
                    for entry_id, fields in entries:
                        last_id = as_str(entry_id)
                        await self.handle(fields.get(ENTRY_FIELD))
        finally:
            for task in self.tokenizing:
                task.cancel()

    async def handle(self, raw: bytes | None) -> None:
        try:
            msg = msgpack.unpackb(raw, raw=False)
            kind, rid = msg["k"], msg["rid"]
        except Exception:
            log.warning("ignoring malformed control entry %r", raw[:100] if raw else raw)
            return
        st = self.table.get(rid)
        if kind == "cancel":
            if st is not None and not st.engine_done:
                self.engine.submit(Cancel(rid, received_at=time.time()))
        elif kind == "attach":
            gw, att = msg.get("gw"), msg.get("att")
            if not isinstance(gw, str) or not gw or not isinstance(att, int):
                log.warning("ignoring malformed attach %r", msg)
            elif st is not None:
                await with_backoff(lambda: self.writer.attach(st, gw, att), "attach")
            else:
                await with_backoff(lambda: self.writer.attach_unknown(rid, gw, att), "attach")
        elif kind in TOKENIZE_KINDS:
            gw = msg.get("gw")
            if isinstance(gw, str) and gw and isinstance(rid, str):
                task = asyncio.create_task(self.tokenize(rid, gw, msg), name="tokenize")
                self.tokenizing.add(task)
                task.add_done_callback(self.tokenizing.discard)
            else:
                log.warning("ignoring malformed %s entry", kind)
        elif kind == "take":
            entry_id, deliveries = msg.get("entry"), msg.get("deliveries")
            if isinstance(entry_id, str) and isinstance(deliveries, int):
                await self.on_take(entry_id, deliveries)
            else:
                log.warning("ignoring malformed take %r", msg)
        else:
            log.warning("ignoring control entry of unknown kind %r", kind)

    async def tokenize(self, reply_id: str, gw: str, request: dict) -> None:
        """Answer one tokenize / detokenize request into gateway `gw`'s inbox (once: the gateway
        gives up after its own timeout, so a reply Redis refused is not retried)."""
        if len(self.tokenizing) > MAX_TOKENIZING:
            answer = refusal(ErrorCode.OVERLOADED, f"this worker is answering {MAX_TOKENIZING} tokenize requests")
        else:
            try:
                answer = await asyncio.wait_for(self.engine.tokenize(request), TOKENIZE_TIMEOUT_S)
            except TimeoutError:         # the gateway has given up long since; free the slot
                answer = refusal(ErrorCode.STALLED, f"no answer from the tokenizer within {TOKENIZE_TIMEOUT_S:g} s")
        try:
            await self.writer.to_inbox(gw, TokenizeReply.from_answer(reply_id, answer).encode())
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("tokenize reply to gateway %s not written: %s", gw, exc)
