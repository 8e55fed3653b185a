"""Cache-aware routing: which worker a request should run on so that its prompt's prefix is
already in that worker's KV cache (docs/transport.md, "Routing").

Why rendezvous hashing over the live workers: every gateway replica computes the same choice
from the same inputs (the route key and the registry's live workers), with no shared state and
no coordination; when a worker joins or leaves, only the keys whose top choice it was move
(1/N of them), so the other workers' caches stay useful.

The route key is the client's (`prompt_cache_key`, OpenAI's field) or, without one, a digest of
the prompt's first ROUTE_PREFIX_CHARS characters: a shared system prompt, or a conversation's
earlier turns, hash the same on every turn. Only a preference: the worker that reads an entry
routed to another live worker with room hands it over (worker.intake), and anything else (no
route, its worker dead or full) runs wherever it is read.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

ROUTE_PREFIX_CHARS = 2048     # about the first 500 tokens: a system prompt, a conversation's opening turns


def route_key(explicit: str | None, prompt: str | None, messages: list[dict] | None) -> str:
    """The key requests that should share a worker have in common."""
    if explicit:
        return "k:" + explicit
    if prompt is not None:
        text = prompt
    else:
        text = "".join(f"{m.get('role')}\x1f{m.get('content')}\x1e" for m in messages or ())
    return "p:" + hashlib.blake2b(text[:ROUTE_PREFIX_CHARS].encode(), digest_size=16).hexdigest()


def rendezvous(key: str, workers: Iterable[str]) -> list[str]:
    """`workers` in the key's preference order (highest random weight first)."""
    def weight(worker: str) -> bytes:
        return hashlib.blake2b(f"{key}\x00{worker}".encode(), digest_size=8).digest()
    return sorted(workers, key=weight, reverse=True)
