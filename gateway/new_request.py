"""Starting a request, whatever the transport: server caps, admission, then one submit round
trip that also takes the per-key rate and concurrency. The WebSocket handler (dispatch.py) and
the OpenAI HTTP API (openai_api.py) both use the one `RequestStarter`, so a limit or a cap is
enforced in one place.

Raises `ProtocolError` (with the client's id) for a refusal; nothing is left behind then. On
success the request is open in `requests` (subscribed to its output before it was queued) and
holds a per-key concurrency slot until its `done`.
"""

from __future__ import annotations

import secrets
import time

from redis.exceptions import RedisError

from gateway.admission import Admission
from gateway.bookkeeping import Bookkeeper
from gateway.request_state import RequestState
from gateway.requests import RequestTable
from gateway.settings import GatewaySettings
from gateway.submit import Submitter
from shared.errors import ErrorCode, ProtocolError
from shared.protocol import Generate
from shared.streams import RequestEntry, SamplingParams


class RequestStarter:
    def __init__(self, settings: GatewaySettings, admission: Admission, submitter: Submitter, bookkeeper: Bookkeeper,
                 gw_id: str):
        self.s = settings
        self.admission = admission
        self.submitter = submitter
        self.bookkeeper = bookkeeper
        self.gw_id = gw_id

    async def start(self, requests: RequestTable, key_id: str, msg: Generate, *,
                    rid: str | None = None) -> RequestState:
        """`rid`: the server id to use (the HTTP API names its response after it); a new 128-bit
        one by default."""
        s, cid = self.s, msg.id
        if msg.prompt_chars() > s.max_prompt_chars:
            raise ProtocolError(ErrorCode.PROMPT_TOO_LARGE,
                                f"prompt of {msg.prompt_chars()} characters exceeds {s.max_prompt_chars}", cid)
        max_tokens = msg.max_tokens if msg.max_tokens is not None else min(s.default_max_tokens, s.max_tokens_cap)
        if max_tokens > s.max_tokens_cap:
            raise ProtocolError(ErrorCode.MAX_TOKENS_TOO_LARGE,
                                f"max_tokens {max_tokens} exceeds the server cap of {s.max_tokens_cap}", cid)
        if len(msg.stop) > s.max_stop_strings:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"at most {s.max_stop_strings} stop strings", cid)
        try:
            await self.admission.admit()         # cached: no round trip on most requests
        except ProtocolError as exc:
            exc.request_id = cid
            raise
        rid = rid or secrets.token_hex(16)       # 128 random bits: the secret a `resume` must present
        req = requests.open(cid, rid, key_id)    # subscribed before it is queued
        entry = RequestEntry(
            rid=rid,
            params=SamplingParams(max_tokens=max_tokens, temperature=msg.temperature, top_p=msg.top_p,
                                  top_k=msg.top_k, seed=msg.seed, stop=list(msg.stop)),
            prompt=msg.prompt,
            messages=[m.model_dump() for m in msg.messages] if msg.messages is not None else None,
            priority=msg.priority, created_ms=int(time.time() * 1000), key_id=key_id, gw=self.gw_id,
        )
        # leases of this key that ended here but are still queued for release go first
        release = self.bookkeeper.take_releases(key_id)
        try:
            # rate limit + concurrency lease + queue: one round trip
            await self.submitter.submit(entry, release=release)
        except ProtocolError as exc:
            requests.drop(req)
            exc.request_id = cid
            raise
        except (RedisError, OSError):
            requests.drop(req)
            for rid_ in release:
                self.bookkeeper.request_ended(key_id, rid_)     # not known to be written: queue again
            raise
        req.slot_held = True
        return req
