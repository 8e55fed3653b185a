"""The KV blocks each request holds, as the scheduler asks for them (vLLM v1's `KVCacheManager`,
nano-vllm's block manager): a prompt's computed (cached) blocks, slots for a request's next
tokens, freeing a request's blocks, publishing the blocks a forward pass filled, and the prefix
cache's hit counters. The scheduler decides who runs and who is preempted; it never touches the
`BlockPool` (block_pool.py: refcounts, the free heap, the cached LRU, names) itself.

A request's part of this state lives on its `Sequence`, where the runner reads it every step:
its block table `blocks`, the names of its context's full blocks `block_names` (computed once
each, as they are looked up or fill), how many of `blocks` are named in the pool `published`,
and `cached_tokens`, the context tokens its first pass took from the cache.

A request that asks for prompt logprobs (completions `echo` + `logprobs`) takes no cached
blocks while they are not all computed: the logits of every prompt position are needed (vLLM's
rule); the blocks it fills are published for others as usual.

Prefix caching (when the pool caches): a request whose computed prefix ends at a block boundary
takes the cached blocks that continue it, on admission and again whenever its prompt is next
scheduled (a request that waited for the prefill budget then finds what an identical one computed
meanwhile), and prefills only the rest. The block holding its last context token is never taken
(its logits are needed; recomputing that block in a fresh one is exact and writes nothing
shared). A request whose next block another request fills in this very step waits a step and
then takes it, instead of computing it twice. Blocks are published (named in the pool) only
after the forward pass that wrote them succeeded (`cache_computed`), so a failed step leaves no
half-written block shareable. Admission counts a request's hit: it needs blocks only for what
follows it, and the hit's blocks nobody holds come out of the free count (`free_after`). Shared
blocks stay correct through preemption and cancel: freeing drops one reference, and a block
nobody holds stays cached (counted free) until it is evicted for new tokens.
"""

from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING

from worker.engine.block_pool import BlockPool, extend_names

if TYPE_CHECKING:
    from worker.engine.sequence import Sequence


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self.caching = pool.caching
        # prefix cache hit rate (totals, for metrics, as vLLM's prefix_cache_queries / _hits):
        # context tokens of requests admitted for the first time, and how many of those were
        # taken from the cache instead of computed (recomputes after preemption count in neither)
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._filling: set[bytes] = set()   # names of the blocks this step's prompt chunks fill

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks a request may take: free ones and cached ones nobody holds."""
        return self.pool.num_free

    # ---- admission ----------------------------------------------------------------------------

    def computed_blocks(self, seq: Sequence) -> list[int]:
        """The cached blocks continuing `seq`'s blocks (all computed, ending at a block boundary),
        up to but never including the block of its last context token; [] without caching."""
        if not self.caching or seq.wants_prompt_rows:    # prompt logprobs: every position computed
            return []
        bs = self.block_size
        limit = (len(seq.tokens) - 1) // bs
        start = len(seq.blocks)
        if start >= limit:
            return []
        if len(seq.block_names) < limit:
            extend_names(seq.block_names, seq.cache_root, seq.tokens, bs, limit, seq.cache_salt, seq.salt_at)
        return self.pool.cached_prefix(islice(seq.block_names, start, limit))

    def free_after(self, hit: list[int]) -> int:
        """Blocks left for new tokens once `hit` is taken: its blocks nobody holds count as free
        now, and taking them uses them up."""
        refs = self.pool.refs
        return self.pool.num_free - sum(1 for block in hit if refs[block] == 0)

    def admit(self, seq: Sequence, hit: list[int]) -> None:
        """`seq` joins the running set with `hit` (`computed_blocks`) as its computed prefix; its
        first admission counts in the hit rate."""
        if seq.preemptions == 0:
            self.prefix_queries += len(seq.tokens)
        self._take(seq, hit)

    # ---- one step ---------------------------------------------------------------------------

    def start_step(self) -> None:
        self._filling.clear()

    def take_computed(self, seq: Sequence) -> bool:
        """Before `seq`'s prompt is scheduled: the cached blocks that now continue its computed
        prefix become its own. False when the block it would take next is being filled in this
        very step by another request: it should wait a step and take it then."""
        bs = self.block_size
        if not self.caching or seq.computed != len(seq.blocks) * bs or seq.wants_prompt_rows:
            return True
        self._take(seq, self.computed_blocks(seq))
        nxt = len(seq.blocks)
        return not (nxt < (len(seq.tokens) - 1) // bs and seq.block_names[nxt] in self._filling)

    def allocate_slots(self, seq: Sequence, n: int) -> bool:
        """Blocks for `seq`'s next `n` tokens; False, taking nothing, when the pool is short."""
        need = -(-(seq.computed + n) // self.block_size) - len(seq.blocks)
        if need > 0:
            if need > self.pool.num_free:
                return False
            seq.blocks.extend(self.pool.allocate(need))
        return True

    def tokens_that_fit(self, seq: Sequence) -> int:
        """How many more tokens `seq` could compute with its blocks and every free one."""
        return (len(seq.blocks) + self.pool.num_free) * self.block_size - seq.computed

    def will_fill(self, seq: Sequence, n: int) -> None:
        """`seq` computes its next `n` prompt tokens this step: the blocks they complete are not
        computed again by another request this step (`take_computed` makes it wait)."""
        if self.caching:
            bs = self.block_size
            self._filling.update(seq.block_names[seq.computed // bs : (seq.computed + n) // bs])

    def cache_computed(self, decode: list[Sequence], prefill: list[tuple[Sequence, int]]) -> None:
        """Publish the blocks a forward pass filled, prompt and generated tokens alike (once the
        pass succeeded and `computed` has moved on): from now on other requests may share them."""
        if not self.caching:
            return
        bs = self.block_size
        for seq in decode:
            if seq.computed >= (seq.published + 1) * bs:
                self._publish(seq)
        for seq, _ in prefill:
            if seq.computed >= (seq.published + 1) * bs:
                self._publish(seq)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s blocks (finished, cancelled or preempted); shared and named ones stay."""
        self.pool.release(seq.blocks)
        seq.blocks = []
        seq.published = 0

    # ---- internals --------------------------------------------------------------------------

    def _take(self, seq: Sequence, hit: list[int]) -> None:
        """`hit` into `seq`'s blocks: computed without computing."""
        if not hit:
            return
        self.pool.take(hit)
        seq.blocks.extend(hit)
        seq.computed += len(hit) * self.block_size
        seq.published = len(seq.blocks)
        if seq.preemptions == 0:
            seq.cached_tokens += len(hit) * self.block_size
            self.prefix_hits += len(hit) * self.block_size

    def _publish(self, seq: Sequence) -> None:
        bs = self.block_size
        full = seq.computed // bs
        if len(seq.block_names) < full:
            extend_names(seq.block_names, seq.cache_root, seq.tokens, bs, full, seq.cache_salt, seq.salt_at)
        for i in range(seq.published, full):
            self.pool.publish(seq.blocks[i], seq.block_names[i])
        seq.published = full
