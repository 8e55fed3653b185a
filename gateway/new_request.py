"""Starting a request, whatever the transport: server caps, admission, then one submit round
trip that also takes the per-key rate and concurrency. Both transports reach it through the one
request core (gateway.request_core), so a limit or a cap is enforced in one place.

Raises `ProtocolError` (with the client's id) for a refusal; nothing is left behind then. On
success the request is open in `requests` (subscribed to its output before it was queued) and
holds a per-key concurrency slot until its `done`.

Idempotency: a generate may carry the client's `idempotency_key`. The submit script records which
request a key started (per API key; anonymous clients share one namespace, where the key itself
is the secret, so it must be at least 32 characters: 128 bits); a second generate with the same
key within OUTPUT_TTL_S starts nothing and raises `AlreadyStarted`, and the request core
attaches the client to the first request like a resume from 0. That is how a client that re-sends a
`generate` whose `accepted` was lost with its gateway gets one request, not two.
"""

from __future__ import annotations

import logging
import secrets
import time

from redis.exceptions import RedisError

from gateway.admission import Admission
from gateway.auth import ANONYMOUS, is_anonymous
from gateway.bookkeeping import Bookkeeper
from gateway.cache_scope import cache_scope
from gateway.request_state import Phase, RequestState
from gateway.requests import RequestTable
from gateway.router import Router
from gateway.settings import GatewaySettings
from gateway.submit import Submitter
from shared.errors import ErrorCode, ProtocolError
from shared.logs import rid_of
from shared.protocol import MIN_ANONYMOUS_IDEMPOTENCY_CHARS, Generate
from shared.sampling import SamplingParams
from shared.streams import RequestEntry
from shared.structured import grammar_for, tool_mode


log = logging.getLogger("gateway.requests")


class AlreadyStarted(Exception):
    """The generate's idempotency key already started request `rid` (of the same owner)."""

    def __init__(self, rid: str):
        super().__init__(rid)
        self.rid = rid


def check_prompt_chars(msg: Generate, limit: int) -> None:
    """MAX_PROMPT_CHARS: the prompt's text (all messages together)."""
    if msg.prompt_chars() > limit:
        raise ProtocolError(ErrorCode.PROMPT_TOO_LARGE, f"prompt of {msg.prompt_chars()} characters exceeds {limit}",
                            msg.id)


def sampling_params(msg: Generate, max_tokens: int) -> SamplingParams:
    """The generate's sampling fields as the request entry carries them."""
    if msg.min_tokens > max_tokens:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"min_tokens {msg.min_tokens} exceeds max_tokens {max_tokens}",
                            msg.id, param="min_tokens")
    return SamplingParams(max_tokens=max_tokens, temperature=msg.temperature, top_p=msg.top_p,
                          top_k=max(msg.top_k, 0), seed=msg.seed, stop=list(msg.stop),
                          grammar=grammar_for(msg.response_format, msg.tools, msg.tool_choice),
                          logprobs=(msg.top_logprobs or 0) if msg.logprobs else None,
                          ignore_eos=msg.ignore_eos, presence_penalty=msg.presence_penalty,
                          frequency_penalty=msg.frequency_penalty, repetition_penalty=msg.repetition_penalty,
                          logit_bias={int(k): v for k, v in msg.logit_bias.items()} if msg.logit_bias else None,
                          min_p=msg.min_p, min_tokens=msg.min_tokens, stop_token_ids=list(msg.stop_token_ids),
                          include_stop_str_in_output=msg.include_stop_str_in_output,
                          skip_special_tokens=msg.skip_special_tokens, prompt_logprobs=msg.prompt_logprobs,
                          echo=msg.echo)


def entry_prompt(msg: Generate) -> tuple[str | None, list[dict] | None, list[dict] | None]:
    """(prompt, messages, tools) as the request entry carries them to the worker's prompt
    building; a /tokenize request sends the same, so it gets the ids a generate would run."""
    messages = [m.model_dump(exclude_none=True) for m in msg.messages] if msg.messages is not None else None
    tools = [t.model_dump(exclude_none=True) for t in msg.tools] if msg.tools and msg.tool_choice != "none" else None
    return msg.prompt, messages, tools


def route_text(msg: Generate) -> str | None:
    """What routes a raw prompt (shared.routing): its text, or its token ids spelled out."""
    return msg.prompt if msg.prompt_ids is None else " ".join(map(str, msg.prompt_ids[:1024]))


class RequestStarter:
    def __init__(self, settings: GatewaySettings, admission: Admission, submitter: Submitter, bookkeeper: Bookkeeper,
                 gw_id: str, router: Router):
        self.s = settings
        self.router = router
        self.admission = admission
        self.submitter = submitter
        self.bookkeeper = bookkeeper
        self.gw_id = gw_id

    async def start(self, requests: RequestTable, key_id: str, msg: Generate, *,
                    rid: str | None = None, replaces: str = "") -> RequestState:
        """`rid`: the server id to use (the HTTP API names its response after it); a new 128-bit
        one by default. `replaces`: the request `msg`'s idempotency key named, cancelled as an
        orphan before this re-send could attach to it: this one takes the key over, and that
        one's concurrency slot goes (it never runs on)."""
        s, cid = self.s, msg.id
        check_prompt_chars(msg, s.max_prompt_chars)
        max_tokens = msg.max_tokens if msg.max_tokens is not None else min(s.default_max_tokens, s.max_tokens_cap)
        if max_tokens > s.max_tokens_cap:
            raise ProtocolError(ErrorCode.MAX_TOKENS_TOO_LARGE,
                                f"max_tokens {max_tokens} exceeds the server cap of {s.max_tokens_cap}", cid)
        if len(msg.stop) > s.max_stop_strings:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"at most {s.max_stop_strings} stop strings", cid)
        params = sampling_params(msg, max_tokens)
        idem = None
        if msg.idempotency_key is not None:
            anonymous = is_anonymous(key_id)
            if anonymous and len(msg.idempotency_key) < MIN_ANONYMOUS_IDEMPOTENCY_CHARS:
                raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                    f"without an API key, idempotency_key is the only secret: use at least "
                                    f"{MIN_ANONYMOUS_IDEMPOTENCY_CHARS} random characters (128 bits; e.g. 32 hex "
                                    f"digits)", cid)
            idem = self.submitter.idem_key(ANONYMOUS if anonymous else key_id, msg.idempotency_key)
        try:
            await self.admission.admit()         # cached: no round trip on most requests
        except ProtocolError as exc:
            exc.request_id = cid
            raise
        rid = rid or secrets.token_hex(16)       # 128 random bits: the secret a `resume` must present
        req = requests.open(cid, rid, key_id)    # subscribed before it is queued
        prompt, messages, tools = entry_prompt(msg)
        scope = cache_scope(key_id, msg.cache_salt)
        entry = RequestEntry(
            rid=rid,
            params=params,
            prompt=prompt,
            prompt_ids=list(msg.prompt_ids) if msg.prompt_ids is not None else None,
            messages=messages,
            tools=tools,
            priority=msg.priority, created_ms=int(time.time() * 1000), key_id=key_id, gw=self.gw_id,
            route=self.router.pick(msg.prompt_cache_key, route_text(msg), messages, scope), cache_salt=scope,
        )
        # leases of this key that ended here but are still queued for release go first
        release = self.bookkeeper.take_releases(key_id) + ([replaces] if replaces else [])
        try:
            # rate limit + concurrency lease + queue: one round trip
            first = await self.submitter.submit(entry, release=release, idem=idem, replaces=replaces,
                                                tool_mode=tool_mode(msg.tools, msg.tool_choice))
        except ProtocolError as exc:
            requests.drop(req)
            exc.request_id = cid
            raise
        except (RedisError, OSError):
            requests.drop(req)
            for rid_ in release:
                self.bookkeeper.request_ended(key_id, rid_)     # not known to be written: queue again
            raise
        finally:
            self.admission.refresh_if_due()      # off this request's path (Admission's docstring)
        if first is not None:
            requests.drop(req)
            log.debug("request %s not started: its idempotency key started %s", rid, first, extra=rid_of(first))
            raise AlreadyStarted(first)
        req.advance(Phase.STARTED)
        log.debug("request %s queued for %s as %r (%d prompt chars, max_tokens %d)", rid, key_id, cid,
                  msg.prompt_chars(), max_tokens, extra=rid_of(rid))
        return req
