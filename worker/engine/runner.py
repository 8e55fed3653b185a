"""Executing a `StepPlan`: pack its tokens into one sequence, run the model once, sample.

The runner owns the model call and the per-step index tensors; it never changes request
state (the engine does that from the sampled tokens), so a failed forward pass leaves every
request as it was. Input ids, positions and cache coordinates are written into buffers
allocated once (`max_batch + prefill_chunk` tokens), the shape CUDA graphs for decode-only
steps need (capture itself is not done: it needs a GPU to be developed and tested on).
"""

from __future__ import annotations

import torch

from worker.engine import attention
from worker.engine.attention import PrefillChunk, StepMeta, decode_segments
from worker.engine.kv_cache import SlotKVCache
from worker.engine.sampling import sample
from worker.engine.scheduler import StepPlan


class ModelRunner:
    def __init__(self, model, cache: SlotKVCache, *, groups: int, max_tokens: int, device: torch.device,
                 dtype: torch.dtype):
        self.model = model
        self.cache = cache
        self.groups = groups
        self.device = device
        self.dtype = dtype
        self.shared_generator = torch.Generator(device=device)
        self.shared_generator.seed()
        self.eos_ids: set[int] = set()  # masked for requests with ignore_eos
        pin = device.type == "cuda"
        # host staging: [ids, positions, slots] rows, copied to the device in one transfer
        self._host = torch.zeros(3, max_tokens, dtype=torch.long, pin_memory=pin)
        self._dev = self._host if device.type == "cpu" else torch.zeros(3, max_tokens, dtype=torch.long, device=device)
        # A 4D tensor makes transformers return it as the "mask" untouched instead of building
        # a causal mask over the packed sequence that slot attention would not read.
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)

    def execute(self, plan: StepPlan) -> list[int]:
        """Token ids sampled for `plan.sampled`, in that order."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for seq in plan.decode:
            ids.append(seq.tokens[seq.computed])
            pos.append(seq.computed)
            slots.append(seq.slot)
        keep = list(range(len(plan.decode)))
        chunks = []
        for seq, n in plan.prefill:
            start = seq.computed
            ids.extend(seq.tokens[start : start + n])
            pos.extend(range(start, start + n))
            slots.extend([seq.slot] * n)
            chunks.append(PrefillChunk(seq.slot, start, n))
            if start + n == len(seq.tokens):
                keep.append(len(ids) - 1)
        total = len(ids)
        self._host[0, :total] = torch.tensor(ids)
        self._host[1, :total] = torch.tensor(pos)
        self._host[2, :total] = torch.tensor(slots)
        if self._dev is not self._host:
            self._dev[:, :total].copy_(self._host[:, :total], non_blocking=True)
        ids_t, pos_t, slots_t = self._dev[0, :total], self._dev[1, :total], self._dev[2, :total]
        meta = StepMeta(cache=self.cache, write_slots=slots_t, write_pos=pos_t, num_decode=len(plan.decode),
                        groups=self.groups, dtype=self.dtype, prefills=chunks)
        if plan.decode:
            self._decode_layout(meta, plan)
        sampled = plan.sampled
        with torch.inference_mode():
            out = self.model(
                input_ids=ids_t[None], position_ids=pos_t[None], attention_mask=self._no_mask,
                logits_to_keep=torch.tensor(keep or [total - 1], device=self.device),
                use_cache=False, **{attention.META_KWARG: meta},
            )
            if not sampled:
                return []
            logits = out.logits[0]
            masked = [row for row, s in enumerate(sampled) if s.req.ignore_eos]
            if masked and self.eos_ids:
                rows = torch.tensor(masked, device=self.device)[:, None]
                logits[rows, torch.tensor(sorted(self.eos_ids), device=self.device)[None, :]] = float("-inf")
            params = [s.req.params for s in sampled]
            tokens = sample(logits, [p.temperature for p in params], [p.top_k for p in params],
                            [p.top_p for p in params], [s.generator for s in sampled], self.shared_generator)
        return tokens.tolist()

    def _decode_layout(self, meta: StepMeta, plan: StepPlan) -> None:
        """Decode rows are cache slots [0, rows): slot s's query goes to row s."""
        decode = plan.decode
        rows = decode[-1].slot + 1
        lengths = [1] * rows  # rows without a decode token attend to one position; ignored
        for seq in decode:
            lengths[seq.slot] = seq.computed + 1
        meta.rows = rows
        meta.max_len = max(lengths)
        if rows != len(decode):
            row_token = [0] * rows
            for i, seq in enumerate(decode):
                row_token[seq.slot] = i
            meta.row_token = torch.tensor(row_token, device=self.device)
            meta.decode_rows = torch.tensor([s.slot for s in decode], device=self.device)
        meta.decode_lengths = torch.tensor(lengths, device=self.device)
        meta.segments = decode_segments(lengths)
