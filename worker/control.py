"""Control entries for this worker (`p:{w:<id>}:ctl`): cancel and attach.

Why its own module: a gateway reaches the worker that owns a request only through this stream
(the owner is in meta), and each message kind has one handler here.

* cancel: goes straight into the engine inbox, effective at the next step boundary;
* take (routing): another worker handed us a request entry routed here; it is in our pending
  list, intake runs it (worker.intake.take_forwarded);
* attach (a client resumed on gateway `gw`): the request's live events are routed to `gw`'s
  inbox from now on; the writer flushes what it has, then sends the attach marker "everything
  <= S is in history" (worker.output_writer.OutputWriter.attach). For a request this worker
  does not hold, the marker says `seq: null` (read the history to its end).
"""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable

import msgpack

from shared.streams import ENTRY_FIELD, Keys, as_str
from worker.engine_client import Cancel, EngineClient
from worker.inflight import InFlightTable
from worker.output_writer import OutputWriter
from worker.redis_io import with_backoff

log = logging.getLogger("worker.control")

BLOCK_MS = 1000


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

    async def loop(self) -> None:
        key = self.keys.ctl(self.worker_id)
        # An explicit id, not "$": with "$" every XREAD that times out would restart from the
        # then-newest entry, dropping a message that lands between two calls.
        last_id = f"{int(time.time() * 1000)}-0"
        while True:
            resp = await with_backoff(lambda: self.blocking_redis.xread({key: last_id}, count=256, block=BLOCK_MS),
                                      "read control")
            for _stream, entries in resp or []:
                for entry_id, fields in entries:
                    last_id = as_str(entry_id)
                    await self.handle(fields.get(ENTRY_FIELD))

    async def handle(self, raw: bytes | None) -> None:
        try:
            msg = msgpack.unpackb(raw, raw=False)
            kind, rid = msg["k"], msg["rid"]
        except Exception:
            log.warning("ignoring malformed control entry %r", raw[:100] if raw else raw)
            return
        st = self.table.requests.get(rid)
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
        elif kind == "take":
            entry_id, deliveries = msg.get("entry"), msg.get("deliveries")
            if isinstance(entry_id, str) and isinstance(deliveries, int):
                await self.on_take(entry_id, deliveries)
            else:
                log.warning("ignoring malformed take %r", msg)
        else:
            log.warning("ignoring control entry of unknown kind %r", kind)
