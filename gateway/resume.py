"""`resume`: re-attach a request started on an earlier socket (any replica) to this one.

Authorization and the attach both live here, so what a resume may see is decided in one place.
The request is looked up by (API key, client id); an optional `request_id` must match. Only
after the per-key slot is taken is the attach epoch bumped, which spares a parked orphan from
the sweeper; output after `last_seq` is then replayed from the request's retained stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.errors import ErrorCode, ProtocolError
from shared.protocol import Resume

if TYPE_CHECKING:
    from gateway.dispatch import MessageHandler


async def resume(handler: MessageHandler, msg: Resume) -> None:
    cid, hub = msg.id, handler.hub
    handler.check_new_id(cid)
    rid = await hub.submitter.lookup_alias(handler.key_id, cid)
    if rid is None or (msg.request_id is not None and msg.request_id != rid):
        raise ProtocolError(ErrorCode.RESUME_EXPIRED, f"no retained output for request {cid!r}", cid)
    try:
        await hub.limits.acquire(handler.key_id, rid)
    except ProtocolError as exc:
        exc.request_id = cid
        raise
    epoch = await hub.submitter.attach(rid)     # only now: a parked orphan is spared
    req = handler.requests.open(cid, rid, handler.key_id, skip_seq=msg.last_seq, resumed=True)
    req.slot_held = True
    req.epoch = epoch
    handler.accept(req)
