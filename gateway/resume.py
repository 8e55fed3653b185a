"""`resume`: re-attach a request started on an earlier connection (any replica) to this one.

Authorization and the attach both live here, so what a resume may see is decided in one place.
The request is looked up by (API key, client id); an optional `request_id` must match. Only
after the per-key slot is taken is the attach epoch bumped, which spares a parked orphan from
the sweeper; output after `last_seq` is then replayed from the request's retained stream.
A WebSocket `resume` and an SSE reconnect with `Last-Event-ID` (openai_api.py) both come here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.errors import ErrorCode, ProtocolError
from shared.protocol import Resume

if TYPE_CHECKING:
    from gateway.hub import Hub
    from gateway.requests import RequestState, RequestTable


async def reattach(hub: Hub, requests: RequestTable, key_id: str, msg: Resume) -> RequestState:
    """Open `msg.id` in `requests` again, replaying its output after `msg.last_seq`.

    Transport-neutral: the WebSocket `resume` and the OpenAI API's SSE resume both use it."""
    cid = msg.id
    rid = await hub.submitter.lookup_alias(key_id, cid)
    if rid is None or (msg.request_id is not None and msg.request_id != rid):
        raise ProtocolError(ErrorCode.RESUME_EXPIRED, f"no retained output for request {cid!r}", cid)
    try:
        await hub.limits.acquire(key_id, rid)
    except ProtocolError as exc:
        exc.request_id = cid
        raise
    epoch = await hub.submitter.attach(rid)     # only now: a parked orphan is spared
    req = requests.open(cid, rid, key_id, skip_seq=msg.last_seq, resumed=True)
    req.slot_held = True
    req.epoch = epoch
    return req
