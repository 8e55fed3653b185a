"""Who holds which KV block, and prefix caching: full blocks named by their content, kept after
their requests end, shared by any later request whose context starts the same way (vLLM v1's
automatic prefix caching, `block_pool.py` / `kv_cache_utils.py`; nano-vllm's block manager).

A block of the pool is in exactly one of three states:

* free: holds nothing anyone will read; handed out lowest first (a heap), which keeps a
  request's blocks mostly ascending and the used part of the pool compact;
* used: held by `refs[b]` >= 1 running requests. Only full blocks whose KV is written are ever
  shared (a request writes only positions past its computed prefix, which lie in blocks of its
  own), so no block is written while shared and there is no copy-on-write;
* cached: held by nobody, but named: its KV is that of a known run of tokens. It stays where it
  is, so a later request with the same prefix takes it back (refcount 0 -> 1) instead of
  computing it again; it is handed out for new tokens only when no free block is left, least
  recently released first (an LRU), and then forgets its name.

Caching therefore costs no memory: it lives in blocks that would otherwise sit free, and
admission counts cached blocks as free (`num_free`).

Names: block i of a request's context (prompt, then generated tokens) is named
blake2b(name of block i-1 || its token ids), the chain rooted at `prefix_root`: a digest of
whatever else changes the KV of the same ids (the model, its dtype and quantization, the block
size); a request's cache salt (its tenant's scope) enters the chain at its first block, or after
the blocks of an operator-shared prefix (`extend_names`). A name so stands for the whole prefix up to the block's
end, position included; 128-bit digests make two different prefixes sharing a name a 2^-64
event even for a chosen input, so a hit is trusted without comparing tokens. Names are computed
once per block, when it is looked up or fills (`extend_names`), never again per step.
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict
from hashlib import blake2b

NAME_BYTES = 16


def prefix_root(*parts: object) -> bytes:
    """The name every chain starts from: a digest of what makes KV differ for equal ids."""
    return blake2b(repr(parts).encode(), digest_size=NAME_BYTES).digest()


def extend_names(names: list[bytes], root: bytes, tokens: list[int], block_size: int, blocks: int,
                 salt: bytes = b"", salt_at: int = 0) -> None:
    """Extend `names` (the chain of a context's leading full blocks) to its first `blocks` blocks;
    `tokens` must hold them whole. A `salt` (the request's cache scope) enters the chain at block
    `salt_at` (0: the root; later: after blocks every scope shares, worker.engine.shared_prefix),
    so the blocks from there on are named apart from every other scope's."""
    parent = names[-1] if names else root
    for i in range(len(names), blocks):
        if salt and i == salt_at:
            # its own domain (`person`): no salt can make this input equal a block's, so a
            # chosen salt never lands its chain on another scope's names
            parent = blake2b(parent + salt, digest_size=NAME_BYTES, person=b"cache-salt").digest()
        ids = array("q", tokens[i * block_size : (i + 1) * block_size]).tobytes()
        parent = blake2b(parent + ids, digest_size=NAME_BYTES).digest()
        names.append(parent)


class BlockPool:
    def __init__(self, num_blocks: int, caching: bool):
        self.num_blocks = num_blocks
        self.caching = caching            # False: blocks are never named, the pool is a plain free list
        self.refs = [0] * num_blocks      # requests holding each block
        self._free = list(range(num_blocks))   # a heap
        self._cached: OrderedDict[int, None] = OrderedDict()   # refcount 0 and named, least recent first
        self._by_name: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}

    @property
    def num_free(self) -> int:
        """Blocks a request may take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks nobody holds that keep a named prefix (a subset of `num_free`)."""
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self, n: int) -> list[int]:
        """`n` blocks for new tokens (refcount 1): free ones first, lowest first, then the least
        recently released cached ones, which lose their names. The caller checks `num_free`."""
        if n > self.num_free:
            raise RuntimeError(f"KV cache: {n} blocks asked, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                block = heapq.heappop(self._free)
            else:
                block, _ = self._cached.popitem(last=False)
                del self._by_name[self._name_of.pop(block)]
            self.refs[block] = 1
            out.append(block)
        return out

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each of `blocks` (a request's table, in order). A block nobody
        holds any more is cached if named, else free. The table's last block is released first,
        so the LRU evicts a request's tail before the prefix that more requests share. Stale
        contents of free blocks are never read unmasked: attention only reads positions below
        each request's length, and a new owner writes before it reads."""
        refs = self.refs
        for block in reversed(blocks):
            refs[block] -= 1
            if refs[block] == 0:
                if block in self._name_of:
                    self._cached[block] = None
                else:
                    heapq.heappush(self._free, block)

    def cached_prefix(self, names) -> list[int]:
        """The blocks holding the longest leading run of `names` (looked up, not taken)."""
        out = []
        for name in names:
            block = self._by_name.get(name)
            if block is None:
                break
            out.append(block)
        return out

    def take(self, blocks: list[int]) -> None:
        """Share named blocks with one more request (a cached one stops being evictable)."""
        refs = self.refs
        for block in blocks:
            if refs[block] == 0:
                del self._cached[block]
            refs[block] += 1

    def publish(self, block: int, name: bytes) -> None:
        """`block` (held, full, its KV written) now holds the prefix `name`: later requests may
        share it. If another block already holds that name, this one stays unnamed (a duplicate
        computed meanwhile) and is simply freed when released."""
        if name not in self._by_name and block not in self._name_of:
            self._by_name[name] = block
            self._name_of[block] = name

    def check(self) -> None:
        """Assert the pool's invariants (tests)."""
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free) and not free & cached
        assert all(self.refs[b] == 0 for b in free | cached) and not free & set(self._name_of)
        assert cached == {b for b in self._name_of if self.refs[b] == 0}
        assert len(free) + len(cached) + sum(r > 0 for r in self.refs) == self.num_blocks
        assert all(self._by_name[n] == b for b, n in self._name_of.items()) and len(self._by_name) == len(self._name_of)
