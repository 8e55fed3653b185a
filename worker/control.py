"""Control entries for this worker (`p:{w:<id>}:ctl`): cancel and attach.

Why its own module: a gateway reaches the worker that owns a request only through this stream
(the owner is in meta), and each message kind has one handler here.

* cancel: goes straight into the engine inbox, effective at the next step boundary;
* attach (a client resumed on gateway `gw`): the request's live events are routed to `gw`'s
  inbox from now on; the writer flushes what it has, then sends the attach marker "everything
  <= S is in history" (worker.output_writer.OutputWriter.attach). For a request this worker
  does not hold, the marker says `seq: null` (read the history to its end).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import msgpack

from shared.streams import ENTRY_FIELD, as_str
from worker.engine_thread import Cancel
from worker.redis_io import with_backoff

if TYPE_CHECKING:
    from worker.service import WorkerService

log = logging.getLogger("worker.control")

BLOCK_MS = 1000


class Control:
    def __init__(self, svc: "WorkerService"):
        self.svc = svc

    async def loop(self) -> None:
        svc = self.svc
        key = svc.keys.ctl(svc.worker_id)
        # An explicit id, not "$": with "$" every XREAD that times out would restart from the
        # then-newest entry, dropping a message that lands between two calls.
        last_id = f"{int(time.time() * 1000)}-0"
        while True:
            resp = await with_backoff(lambda: svc.ctl_redis.xread({key: last_id}, count=256, block=BLOCK_MS),
                                      "read control")
            for _stream, entries in resp or []:
                for entry_id, fields in entries:
                    last_id = as_str(entry_id)
                    await self.handle(fields.get(ENTRY_FIELD))

    async def handle(self, raw: bytes | None) -> None:
        svc = self.svc
        try:
            msg = msgpack.unpackb(raw, raw=False)
            kind, rid = msg["k"], msg["rid"]
        except Exception:
            log.warning("ignoring malformed control entry %r", raw[:100] if raw else raw)
            return
        st = svc.inflight.get(rid)
        if kind == "cancel":
            if st is not None and not st.engine_done:
                svc.thread.submit(Cancel(rid))
        elif kind == "attach":
            gw, att = msg.get("gw"), msg.get("att")
            if not isinstance(gw, str) or not gw or not isinstance(att, int):
                log.warning("ignoring malformed attach %r", msg)
            elif st is not None:
                await with_backoff(lambda: svc.writer.attach(st, gw, att), "attach")
            else:
                await with_backoff(lambda: svc.writer.attach_unknown(rid, gw, att), "attach")
        else:
            log.warning("ignoring control entry of unknown kind %r", kind)
