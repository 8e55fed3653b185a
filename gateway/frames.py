"""The `chunk` and `done` frames of a request, built from shared/protocol.py's models.

The models are the one definition of what a client receives; building the frames here (not as
dicts next to the send) keeps the gateway and the documented schema from drifting apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.flusher import Pending
from shared.errors import RETRYABLE, ErrorCode
from shared.protocol import Chunk, Done, TokenLogprob, TopLogprob, Usage

if TYPE_CHECKING:
    from gateway.request_state import RequestState

FINISH_REASONS = ("stop", "length", "cancelled", "error")


def chunk_frame(client_id: str, pending: Pending) -> Chunk:
    logprobs = None if pending.logprobs is None else [token_logprob(e) for e in pending.logprobs]
    return Chunk(id=client_id, seq=pending.seq, text=pending.text, tokens=pending.tokens, logprobs=logprobs)


def token_logprob(entry) -> TokenLogprob:
    """A worker's logprob entry [token, logprob, [[token, logprob], ...], text_offset] as sent to
    clients; `bytes` are the token string's UTF-8 (vLLM's rule)."""
    token, logprob, top, offset = entry
    return TokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()), text_offset=offset,
                        top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in top])


def done_frame(req: RequestState, now: float) -> Done:
    """The request's one `done`, from its final event (`done` or `err`) and the gateway's timings."""
    ev = req.final
    usage_in = ev.get("usage") or {}
    if req.first_sent is not None and not req.resumed:      # as this gateway saw it: accepted -> first chunk
        ttft_ms = round((req.first_sent - req.started) * 1000, 3)
    else:       # a resume: the worker's figure (submit -> first token), whoever streamed it
        ttft_ms = usage_in.get("ttft_ms")
        ttft_ms = float(ttft_ms) if isinstance(ttft_ms, (int, float)) else None
    usage = Usage(
        prompt_tokens=int(usage_in.get("prompt_tokens") or 0),
        completion_tokens=int(usage_in.get("completion_tokens") or 0),
        cached_tokens=int(usage_in.get("cached_tokens") or 0),
        total_ms=round((now - req.started) * 1000, 3),
        ttft_ms=ttft_ms,
    )
    seq = max(req.seq, int(ev.get("seq") or 0))
    if ev.get("k") == "err":
        code = error_code(ev.get("code"))
        error = {"code": code.value, "message": str(ev.get("message") or code.value),
                 "retryable": bool(ev.get("retryable", code in RETRYABLE))}
        return Done(id=req.client_id, seq=seq, finish_reason="error", usage=usage, error=error)
    reason = ev.get("finish_reason")
    return Done(id=req.client_id, seq=seq, finish_reason=reason if reason in FINISH_REASONS else "stop", usage=usage)


def error_code(value) -> ErrorCode:
    try:
        return ErrorCode(value)
    except ValueError:
        return ErrorCode.INTERNAL
