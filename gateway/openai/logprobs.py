"""OpenAI's two logprobs shapes, built from the per-token entries a chunk carries
(shared.protocol.TokenLogprob): the chat one (`{"content": [...], "refusal": null}`) and the
legacy completions one (`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`), which
with `echo` lists the prompt's tokens first (the first with `null`s, as vLLM returns it).

Kept apart from gateway.openai.schema, which only decides which request fields turn them on: what
the values mean (the raw model's log-softmax, as vLLM returns by default) is the engine's
(worker.engine.logprobs), docs/clients.md says it for users.
"""

from __future__ import annotations

from shared.protocol import MAX_TOP_LOGPROBS, TokenLogprob

CHAT_TOP_MAX = MAX_TOP_LOGPROBS   # chat `top_logprobs`
COMPLETIONS_TOP_MAX = 5    # completions `logprobs`


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    """A choice's `logprobs` of a chat completion (or of one of its chunks)."""
    return {"content": [e.model_dump(exclude={"text_offset"}) for e in entries], "refusal": None}


def completion_logprobs(entries: list[TokenLogprob]) -> dict:
    """A choice's `logprobs` of a text completion: `top_logprobs[i]` maps the most likely tokens
    to their logprobs, with the sampled token added when it is not among them (OpenAI: "up to
    logprobs + 1 elements")."""
    top: list[dict[str, float] | None] = []
    for e in entries:
        if e.logprob is None:           # an echoed prompt's first token: nothing precedes it (vLLM: null)
            top.append(None)
            continue
        alternatives = {t.token: t.logprob for t in e.top_logprobs}
        alternatives.setdefault(e.token, e.logprob)
        top.append(alternatives)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": top, "text_offset": [e.text_offset for e in entries]}
