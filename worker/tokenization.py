"""Tokenize and detokenize requests from gateways (vLLM's `POST /tokenize` and `/detokenize`),
answered with the engine's own tokenizer and prompt building (worker.engine.prompts), so the
ids of a chat are exactly those a generate with the same messages and tools runs.

The gateway has no tokenizer (no torch or transformers in its image). It appends a `tokenize`
or `detokenize` entry (shared.streams.encode_tokenize) with a one-shot reply id to one live
worker's control stream; worker.control hands it to the engine client (`EngineClient.tokenize`:
a thread of its own beside the engine's step loop, in the engine process by default) and
appends the answer to the gateway's inbox as a `tokr` event for that reply id (shared.events.TokenizeReply).

`answer` runs on that thread; it never raises: a refusal is `{"error": {code, message, param}}`.
"""

from __future__ import annotations

import logging

from shared.errors import ErrorCode
from shared.events import ReplyError
from worker.engine.prompts import build_prompt_ids

log = logging.getLogger("worker.tokenization")


def refusal(code: ErrorCode, message: str, param: str | None = None) -> dict:
    return {"error": ReplyError(code.value, message[:500], param).to_map()}


def answer(tokenizer, request: dict, max_model_len: int) -> dict:
    """The reply to one request: `{"tokens", "token_strs", "max_model_len"}` for a tokenize,
    `{"prompt"}` for a detokenize, or a refusal."""
    try:
        if request.get("k") == "detokenize":
            return _detokenize(tokenizer, request.get("tokens"))
        return _tokenize(tokenizer, request, max_model_len)
    except Exception as exc:   # a bug or a tokenizer's surprise fails this request only
        log.exception("tokenize request failed")
        return refusal(ErrorCode.INTERNAL, f"tokenizing failed: {type(exc).__name__}: {exc}")


def _tokenize(tokenizer, request: dict, max_model_len: int) -> dict:
    prompt, messages = request.get("prompt"), request.get("messages")
    param = "messages" if messages is not None else "prompt"
    try:
        ids = build_prompt_ids(tokenizer, prompt, messages, request.get("tools"),
                               add_generation_prompt=bool(request.get("add_generation_prompt", True)),
                               continue_final_message=bool(request.get("continue_final_message", False)),
                               add_special_tokens=request.get("add_special_tokens"))
    except Exception as exc:   # what a generate would refuse the same way (a template's own checks)
        return refusal(ErrorCode.INVALID_REQUEST, f"could not build the prompt: {exc}", param)
    strs = [str(s) for s in tokenizer.convert_ids_to_tokens(ids)] if request.get("return_token_strs") else None
    return {"tokens": ids, "token_strs": strs, "max_model_len": int(max_model_len)}


def _detokenize(tokenizer, tokens) -> dict:
    if not isinstance(tokens, (list, tuple)) or not all(type(t) is int for t in tokens):
        return refusal(ErrorCode.INVALID_REQUEST, "tokens must be a list of token ids", "tokens")
    vocab = len(tokenizer)
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        return refusal(ErrorCode.INVALID_REQUEST, f"token id {bad} is out of the vocabulary (0 to {vocab - 1})",
                       "tokens")
    return {"prompt": tokenizer.decode(list(tokens))}
