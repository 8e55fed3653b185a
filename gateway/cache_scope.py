"""Which requests may share prefix-cache blocks and a route key: the cache scope (vLLM's
`cache_salt`, docs/operations.md "What is shared between tenants").

A worker's prefix cache names each KV block by a hash chain of the tokens up to it; a request
that hits another's blocks is served faster and reports `cached_tokens`, so a tenant that can
time its own requests could learn whether a prompt it guesses was sent by another tenant. The
gateway therefore gives every request a scope, computed once per request, that salts the root
of its block hash chain on the worker (RequestEntry.cache_salt -> EngineRequest.cache_salt) and
its route key (shared.routing): requests share blocks and routing only within one scope.

* default: the request's API key ("t:<key id>"); on a server without keys every client is
  anonymous and all share the one deployment-wide scope "" (nobody to keep apart);
* an explicit `cache_salt` (OpenAI body field, WebSocket `generate` field): "s:<salt>", the same
  for every key that sends it, so clients that agree on a salt share on purpose. A salt is
  only as private as it is hard to guess.

What an operator shares for everyone (the deployment's system prompt) is configured on the
workers (CACHE_SHARED_PREFIXES, worker.engine.shared_prefix): those tokens are cached under the
deployment-wide root whatever the scope; the scope enters the chain right after them.
"""

from __future__ import annotations

from gateway.auth import is_anonymous


def cache_scope(key_id: str, cache_salt: str | None) -> str:
    """The scope of a request by API key `key_id` that sent `cache_salt` (None: none)."""
    if cache_salt is not None:
        return "s:" + cache_salt
    if not key_id or is_anonymous(key_id):
        return ""
    return "t:" + key_id
