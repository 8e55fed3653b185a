"""The operator's shared prefixes: prompt openings (the deployment's system prompt) whose KV
blocks every cache scope shares on purpose (CACHE_SHARED_PREFIXES; docs/operations.md, "What is
shared between tenants").

Requests of different scopes (tenants, gateway.cache_scope) never share cached blocks: the
scope salts their block hash chain. A block that holds only tokens of a text the operator
published for everyone reveals nothing, though, so the salt enters the chain at the first block
that is not wholly inside a configured prefix (`salted_from`): those leading blocks are named as
in the deployment-wide scope and computed once for all tenants, everything after them per scope.

Each text is tokenized once at start, both as a raw prompt and as a chat's system message (the
model's template), and a request's shared part is its longest common token prefix with either,
in whole blocks: a chat whose system message is the configured text shares its template's
opening and the text, up to where the template ends the message. Costs one comparison of the
prompt's first tokens per request, nothing per step.
"""

from __future__ import annotations

from worker.engine.prompts import build_prompt_ids


class SharedPrefixes:
    def __init__(self, tokenizer, texts: tuple[str, ...] | list[str]):
        self.ids: list[list[int]] = []
        for text in texts:
            self.ids.append(build_prompt_ids(tokenizer, text, None))
            self.ids.append(build_prompt_ids(tokenizer, None, [{"role": "system", "content": text}],
                                             add_generation_prompt=False))

    def salted_from(self, prompt_ids: list[int], block_size: int) -> int:
        """The index of the first block of `prompt_ids` that is not wholly a shared prefix's."""
        best = 0
        for ids in self.ids:
            n = min(len(ids), len(prompt_ids))
            if prompt_ids[:n] == ids[:n]:
                best = max(best, n)
                continue
            lo = 0
            while lo < n and prompt_ids[lo] == ids[lo]:
                lo += 1
            best = max(best, lo)
        return best // block_size
