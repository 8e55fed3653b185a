"""The `chunk` and `done` frames of a request, built from shared/protocol.py's models.

The models are the one definition of what a client receives; building the frames here (not as
dicts next to the send) keeps the gateway and the documented schema from drifting apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.flusher import Pending
from shared.events import DoneUsage, ErrEvent, error_code
from shared.protocol import Chunk, Done, PromptLogprob, TokenLogprob, TopLogprob, Usage

if TYPE_CHECKING:
    from gateway.request_state import RequestState

FINISH_REASONS = ("stop", "length", "cancelled", "error")


def chunk_frame(client_id: str, pending: Pending) -> Chunk:
    logprobs = None if pending.logprobs is None else [token_logprob(e) for e in pending.logprobs]
    text, prompt = pending.prompt if pending.prompt is not None else (None, None)
    return Chunk(id=client_id, seq=pending.seq, text=pending.text, tokens=pending.tokens, logprobs=logprobs,
                 prompt_text=text,
                 prompt_logprobs=None if prompt is None else [token_logprob(e, PromptLogprob) for e in prompt])


def token_logprob(entry, cls: type[TokenLogprob] = TokenLogprob) -> TokenLogprob:
    """A worker's logprob entry [token, logprob, [[token, logprob], ...], text_offset] as sent to
    clients; `bytes` are the token string's UTF-8 (vLLM's rule)."""
    token, logprob, top, offset = entry
    return cls(token=token, logprob=logprob, bytes=list(token.encode()), text_offset=offset,
               top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in top])


def done_frame(req: RequestState, now: float) -> Done:
    """The request's one `done`, from its final event (`done` or `err`) and the gateway's timings."""
    ev = req.final
    usage_in = (None if isinstance(ev, ErrEvent) else ev.usage) or DoneUsage()
    if req.first_sent is not None and not req.resumed:      # as this gateway saw it: accepted -> first chunk
        ttft_ms = round((req.first_sent - req.started) * 1000, 3)
    else:       # a resume: the worker's figure (submit -> first token), whoever streamed it
        ttft_ms = float(usage_in.ttft_ms) if usage_in.ttft_ms is not None else None
    usage = Usage(
        prompt_tokens=usage_in.prompt_tokens,
        completion_tokens=usage_in.completion_tokens,
        cached_tokens=usage_in.cached_tokens,
        total_ms=round((now - req.started) * 1000, 3),
        ttft_ms=ttft_ms,
    )
    seq = max(req.seq, ev.seq)
    if isinstance(ev, ErrEvent):
        error = {"code": error_code(ev.code).value, "message": ev.message, "retryable": ev.retryable}
        if ev.param is not None:
            error["param"] = ev.param
        return Done(id=req.client_id, seq=seq, finish_reason="error", usage=usage, error=error)
    reason = ev.finish_reason
    return Done(id=req.client_id, seq=seq, finish_reason=reason if reason in FINISH_REASONS else "stop", usage=usage)
