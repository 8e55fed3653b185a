"""Executing a `StepPlan`: pack its tokens into one sequence, run the decoder once, sample.

The runner owns the model call and the per-step index tensors; it never changes request
state (the engine does that from the sampled tokens), so a failed forward pass leaves every
request as it was. Input ids, positions and the KV pool rows each token writes are staged in a
host buffer allocated once (`max_batch + prefill_chunk` tokens) and copied to the device in one
transfer (pinned and non-blocking on CUDA); block tables of the decode segments and prefill
chunks are small per-step tensors. (CUDA graphs for decode-only steps would capture over these
buffers; capture itself is not done: it needs a GPU to be developed and tested on.)
"""

from __future__ import annotations

import torch

from worker.engine.attention import DecodeSegment, PrefillChunk, StepMeta, decode_segments
from worker.engine.decoder import Decoder
from worker.engine.host_lists import long_tensor
from worker.engine.kv_cache import PagedKVCache, blocks_for
from worker.engine.sampling import sample
from worker.engine.scheduler import StepPlan


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache, *, groups: int, max_tokens: int, max_positions: int,
                 device: torch.device, dtype: torch.dtype):
        self.decoder = Decoder(model, max_positions)
        self.cache = cache
        self.groups = groups
        self.device = device
        self.dtype = dtype
        self.shared_generator = torch.Generator(device=device)
        self.shared_generator.seed()
        self.eos_ids: set[int] = set()  # masked for requests with ignore_eos
        pin = device.type == "cuda"
        # host staging: [ids, positions, pool rows] rows, copied to the device in one transfer
        self._host = torch.zeros(3, max_tokens, dtype=torch.long, pin_memory=pin)
        self._host_np = self._host.numpy()   # the same memory, filled from lists at numpy's speed
        self._dev = self._host if device.type == "cpu" else torch.zeros(3, max_tokens, dtype=torch.long, device=device)

    def execute(self, plan: StepPlan) -> list[int]:
        """Token ids sampled for `plan.sampled`, in that order."""
        bs = self.cache.block_size
        decode = plan.decode
        pos = [seq.computed for seq in decode]
        ids = [seq.tokens[p] for seq, p in zip(decode, pos)]
        rows = [seq.blocks[p // bs] * bs + p % bs for seq, p in zip(decode, pos)]
        keep = list(range(len(decode)))
        chunks = []
        for seq, n in plan.prefill:
            start, blocks = seq.computed, seq.blocks
            ids.extend(seq.tokens[start : start + n])
            pos.extend(range(start, start + n))
            rows.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            chunks.append(PrefillChunk(start, n, long_tensor(blocks[: blocks_for(start + n, bs)], self.device)))
            if start + n == len(seq.tokens):
                keep.append(len(ids) - 1)
        total = len(ids)
        self._host_np[:, :total] = (ids, pos, rows)
        if self._dev is not self._host:
            self._dev[:, :total].copy_(self._host[:, :total], non_blocking=True)
        ids_t, pos_t, rows_t = self._dev[0, :total], self._dev[1, :total], self._dev[2, :total]
        meta = StepMeta(cache=self.cache, write_rows=rows_t, write_pos=pos_t, num_decode=len(plan.decode),
                        groups=self.groups, dtype=self.dtype, prefills=chunks)
        if plan.decode:
            self._decode_layout(meta, plan)
        self.cache.reserve_gather(max([s.blocks.numel() for s in meta.segments] + [c.blocks.numel() for c in chunks]))
        sampled = plan.sampled
        with torch.inference_mode():
            logits = self.decoder(ids_t, pos_t, long_tensor(keep or [total - 1], self.device), meta)
            if not sampled:
                return []
            masked = [row for row, s in enumerate(sampled) if s.ignore_eos]
            if masked and self.eos_ids:
                rows_m = long_tensor(masked, self.device)[:, None]
                logits[rows_m, long_tensor(sorted(self.eos_ids), self.device)[None, :]] = float("-inf")
            temperature, top_k, top_p, generators = zip(*[s.sampling for s in sampled])
            tokens = sample(logits, temperature, top_k, top_p, generators, self.shared_generator)
        return tokens.tolist()

    def _decode_layout(self, meta: StepMeta, plan: StepPlan) -> None:
        """Decode rows in plan order (shortest context first), cut into segments; each segment's
        rows get a block table padded to its longest row (padding blocks are masked out)."""
        bs = self.cache.block_size
        decode = plan.decode
        lengths = [seq.computed + 1 for seq in decode]
        meta.decode_lengths = long_tensor(lengths, self.device)
        for start, end, longest in decode_segments(lengths):
            n = blocks_for(longest, bs)
            table: list[int] = []
            for seq in decode[start:end]:
                own = seq.blocks[:n]
                table.extend(own)
                table.extend([own[0]] * (n - len(own)))
            meta.segments.append(DecodeSegment(start, end, long_tensor(table, self.device), n * bs))
