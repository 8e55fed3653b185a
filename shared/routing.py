"""Cache-aware routing: which worker a request should run on so that its prompt's prefix is
already in that worker's KV cache (docs/transport.md, "Routing").

Why rendezvous hashing over the live workers: every gateway replica computes the same choice
from the same inputs (the route key and the registry's live workers), with no shared state and
no coordination; when a worker joins or leaves, only the keys whose top choice it was move
(1/N of them), so the other workers' caches stay useful.

The route key is the client's (`prompt_cache_key`, OpenAI's field) or, without one, a digest of
what stays the same from turn to turn: for chat, the messages up to and including the first
user message (the system prompt and the conversation's opening), so every turn of a
conversation, which resends its history, lands where that history is cached; for a raw prompt,
its first ROUTE_PREFIX_CHARS characters. Conversations that share a long system prompt but not
their opening spread over the workers (each computes the system prompt once, then keeps it
cached) instead of all landing on one: each message of the opening counts on its own (its
first and last ROUTE_PREFIX_CHARS characters and its length), so a system prompt of any length
cannot push the first user message out of the key, and the hashing work stays bounded per
message. The key is scoped like the prefix cache (`scope`: the request's cache salt,
gateway.cache_scope): requests of different tenants never share a route key, so where a
request lands tells nothing about what another tenant sent. Only a preference: the worker that reads an entry
routed to another live worker with room hands it over (worker.intake), and anything else (no
route, its worker dead or full) runs wherever it is read.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

ROUTE_PREFIX_CHARS = 2048     # about 500 tokens: enough to tell prompts apart, bounded hashing work


def route_key(explicit: str | None, prompt: str | None, messages: list[dict] | None, scope: str = "") -> str:
    """The key requests that should share a worker have in common, within cache scope `scope`
    ("": the deployment-wide scope)."""
    if scope:
        return scope + "\x1f" + route_key(explicit, prompt, messages)
    if explicit:
        return "k:" + explicit
    if prompt is not None:
        text = prompt
    else:
        digest = hashlib.blake2b(digest_size=16)
        for m in messages or ():
            digest.update(_message_part(m))
            if m.get("role") == "user":
                break       # the conversation's first user message: later turns only add after it
        return "p:" + digest.hexdigest()
    return "p:" + hashlib.blake2b(text[:ROUTE_PREFIX_CHARS].encode(), digest_size=16).hexdigest()


def _message_part(message: dict) -> bytes:
    """One opening message's share of the key: its role, the head and tail of its content and
    the content's length (a long message is told apart by its ends, at a bounded cost)."""
    content = message.get("content")
    text = content if isinstance(content, str) else repr(content)   # parts: their repr, as before
    size = len(text)
    if size > 2 * ROUTE_PREFIX_CHARS:
        text = text[:ROUTE_PREFIX_CHARS] + "\x1d" + text[-ROUTE_PREFIX_CHARS:]
    return f"{message.get('role')}\x1f{size}\x1f{text}\x1e".encode()


def rendezvous(key: str, workers: Iterable[str]) -> list[str]:
    """`workers` in the key's preference order (highest random weight first)."""
    def weight(worker: str) -> bytes:
        return hashlib.blake2b(f"{key}\x00{worker}".encode(), digest_size=8).digest()
    return sorted(workers, key=weight, reverse=True)
