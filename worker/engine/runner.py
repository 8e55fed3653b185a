"""Executing a `StepPlan`: pack its tokens into one sequence, run the decoder once, sample.

The runner owns the model call, the per-step index tensors and the per-row state of the running
requests (`input_batch.InputBatch`: sampling parameters, grammar matchers, logprobs wants, block
tables; rows taken and given back as the plan admits and preempts requests, and as the engine
removes those that end). It never changes request state (the scheduler and the engine do that
from the sampled tokens), so a failed forward pass leaves every request as it was. Input ids,
positions, the KV pool rows each token writes and the attention inputs are staged in one host
buffer allocated once (`max_batch + prefill_chunk` tokens) and copied to the device in one
transfer (pinned and non-blocking on CUDA). A step stages only the sampled rows' indices and
gathers their parameters on the device, with no per-row lists of temperatures or generators.

On CUDA (with Triton) every token attends through the paged kernel (`paged_attention.py`), fed
the batch's block tables (row `Sequence.slot`, only new blocks written each step), and a step
that only decodes replays a captured CUDA graph (`cuda_graphs.py`) of the smallest captured batch
size that holds it, its extra rows padded onto the KV cache's scratch block. Elsewhere decode
rows are cut into segments of similar length and prompt chunks attend one by one
(`attention.py`).
"""

from __future__ import annotations

import numpy as np
import torch

from worker.engine import paged_attention, row_kernels
from worker.engine.attention import DecodeSegment, PrefillChunk, StepMeta, decode_segments
from worker.engine.cuda_graphs import DecodeGraphs, capture_sizes
from worker.engine.decoder import Decoder
from worker.engine.grammar import Grammars
from worker.engine.host_lists import long_tensor
from worker.engine.input_batch import InputBatch
from worker.engine.kv_cache import PagedKVCache, blocks_for
from worker.engine.logprobs import LogprobGather, prompt_rows
from worker.engine.sampling import MASK_EOS, sample
from worker.engine.scheduler import StepPlan
from worker.engine.sequence import Sequence
from worker.engine.threads import StepThreads

IDS, POSITIONS, ROWS, LENGTHS, TABLE_ROWS, SLOTS = range(6)   # rows of the staging buffers (SLOTS: sampled rows')


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache, *, groups: int, max_batch: int, max_tokens: int,
                 max_positions: int, device: torch.device, dtype: torch.dtype, cuda_graphs: bool = True,
                 grammars: Grammars | None = None, threads: StepThreads | None = None):
        self.decoder = Decoder(model, max_positions)
        self.row_attention = device.type == "cpu" and row_kernels.installed_attention(model)
        # a step of decode rows runs every layer in one call (decoder.decode_layers: CPU row
        # attention only, so row_attention holds wherever it is set)
        self.one_call_decode = self.decoder.decode_layers is not None
        self.threads = threads if threads is not None and threads.active else None   # CPU: by the step's size
        self.cache = cache
        self.groups = groups
        self.device = device
        self.dtype = dtype
        self.shared_generator = torch.Generator(device=device)
        self.shared_generator.seed()
        self.eos_ids: set[int] = set()  # masked for requests with ignore_eos
        self.grammars = grammars        # structured output's masks (None: no request may have a grammar)
        pin = device.type == "cuda"
        # host staging: [ids, positions, pool rows, lengths, table rows] per token and the slots of
        # the sampled rows, copied to the device in one transfer
        self._host = torch.zeros(6, max_tokens, dtype=torch.long, pin_memory=pin)
        self._host_np = self._host.numpy()   # the same memory, filled from lists at numpy's speed
        self._dev = self._host if device.type == "cpu" else torch.zeros(6, max_tokens, dtype=torch.long, device=device)
        self.logprobs = LogprobGather()
        self.last_logprobs: list | None = None   # per sampled row of the last step: its logprobs or None
        self.last_prompt_rows: list | None = None   # [(request, its prompt logprob rows)] of the last step
        self._eos: tuple[frozenset, torch.Tensor] | None = None   # eos_ids as a device tensor
        # One row per running request (the paged kernel's block tables have one more, holding
        # the scratch block, for the padding rows of a graph step).
        self.paged_kernel = paged_attention.available(device)
        self.batch = InputBatch(max_batch, device,
                                table_width=blocks_for(max_positions, cache.block_size) if self.paged_kernel else 0,
                                scratch_block=cache.scratch_block, context=max_positions,
                                end_ids=lambda: self.eos_ids)
        # set when a non-blocking upload is in flight: the host must not rewrite the pinned
        # staging until the copy has read it (a step that samples nothing never syncs otherwise)
        self._upload_done: torch.cuda.Event | None = None
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and self.paged_kernel and device.type == "cuda":
            self._pad(0, max_batch)
            self._upload()
            self.graphs = DecodeGraphs(self.decoder, self._dev[IDS], self._dev[POSITIONS], self._graph_meta,
                                       capture_sizes(max_batch))

    def remove(self, seq: Sequence) -> None:
        """`seq` left the engine (finished, cancelled, failed): its row is free from now on."""
        self.batch.remove(seq)

    def execute(self, plan: StepPlan) -> list[int]:
        """Token ids sampled for `plan.sampled`, in that order (their logprobs, for the rows
        that ask, in `last_logprobs`). Every plan comes here, an empty one too: its admitted
        and preempted requests take and give back their rows."""
        batch = self.batch
        batch.update(plan)   # first: nothing below may leave an admitted request without its row
        self.last_logprobs = None
        self.last_prompt_rows = None
        if plan.empty:
            return []
        if self._upload_done is not None:
            self._upload_done.synchronize()   # done long ago in practice: a query, not a wait
        if self.threads is not None:
            # a step of decode rows in one call (decode_layers.cpp) takes every core: no Python
            # between its parallel regions, so the team stays hot (threads.py)
            self.threads.fit(len(plan.decode) + sum(n for _, n in plan.prefill),
                             one_call=self.one_call_decode and not plan.prefill)
        bs = self.cache.block_size
        decode = plan.decode
        nd = len(decode)
        graph_rows = self.graphs.size_for(nd) if self.graphs is not None and nd and not plan.prefill else None
        kernel = self.paged_kernel
        pos = [seq.computed for seq in decode]
        ids = [seq.tokens[p] for seq, p in zip(decode, pos)]
        rows = [seq.blocks[p // bs] * bs + p % bs for seq, p in zip(decode, pos)]
        keep = list(range(nd))
        chunks = []
        sampled = plan.sampled
        ns = len(sampled)
        self._host_np[SLOTS, :ns] = [seq.slot for seq in sampled]
        if kernel:   # decode rows are the first sampled rows: their table rows are their slots
            self._host_np[TABLE_ROWS, :nd] = self._host_np[SLOTS, :nd]
        asks: list[tuple[Sequence, int, int]] = []   # prompt logprobs: (request, first position, positions)
        extra: list[int] = []                         # their rows in the packed step
        for seq, n in plan.prefill:
            start, blocks = seq.computed, seq.blocks
            if seq.wants_prompt_rows:   # every prompt position but the last: its next token's logprob
                lo, hi = max(start, len(seq.prompt_rows)), min(start + n, seq.prompt_len - 1)
                if hi > lo:
                    asks.append((seq, lo, hi - lo))
                    extra.extend(range(len(ids) + lo - start, len(ids) + hi - start))
            if kernel:   # the chunk's tokens read their request's table row
                self._host_np[TABLE_ROWS, len(ids) : len(ids) + n] = seq.slot
            else:
                chunks.append(PrefillChunk(start, n, long_tensor(blocks[: blocks_for(start + n, bs)], self.device)))
            ids.extend(seq.tokens[start : start + n])
            pos.extend(range(start, start + n))
            rows.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            if start + n == len(seq.tokens):
                keep.append(len(ids) - 1)
        total = len(ids)
        self._host_np[:ROWS + 1, :total] = (ids, pos, rows)
        if kernel:
            np.add(self._host_np[POSITIONS, :total], 1, out=self._host_np[LENGTHS, :total])
            batch.stage_tables(decode)
            batch.stage_tables(seq for seq, _ in plan.prefill)
        if graph_rows is not None and graph_rows > nd:
            self._pad(nd, graph_rows)
        self._upload()
        with torch.inference_mode():
            if graph_rows is not None:
                normed = self.graphs.replay(graph_rows)
                logits = self.decoder.logits(normed if graph_rows == nd else normed[:nd])
            else:
                ids_t, pos_t, rows_t = self._dev[IDS, :total], self._dev[POSITIONS, :total], self._dev[ROWS, :total]
                meta = StepMeta(cache=self.cache, write_rows=rows_t, write_pos=pos_t, num_decode=nd,
                                groups=self.groups, dtype=self.dtype, prefills=chunks)
                if kernel:
                    meta.block_tables = batch.block_tables
                    meta.table_rows, meta.token_lengths = self._dev[TABLE_ROWS, :total], self._dev[LENGTHS, :total]
                elif nd:
                    self._decode_layout(meta, plan)
                self.cache.reserve_gather(max([s.blocks.numel() for s in meta.segments]
                                              + [c.blocks.numel() for c in chunks], default=0))
                keep_t = None if len(keep) == total and not extra else \
                    long_tensor(keep + extra or [total - 1], self.device)
                logits = self.decoder(ids_t, pos_t, keep_t, meta)
                if extra:
                    self.last_prompt_rows = self._prompt_rows(logits[len(keep):], asks)
                    logits = logits[:len(keep)]
            if not ns:
                return []
            slots = self._host_np[SLOTS, :ns]
            params = batch.sampling.rows(slots, self._dev[SLOTS, :ns])
            asked = None   # raw logits: before the EOS mask
            if batch.num_logprobs:
                asked = self.logprobs.prepare(logits, batch.top_logprobs[slots])
            if batch.penalties.num_active or batch.bias.num_biased or batch.bias.num_min:
                # bias, min_tokens, penalties (vLLM's order) on float32 logits; a copy while
                # logprobs still read the raw ones
                logits = logits.to(torch.float32, copy=asked is not None).contiguous()
                batch.bias.apply(logits, slots)
                if batch.penalties.num_active:
                    batch.penalties.apply(logits, slots)
            if self.eos_ids and params.host[:, MASK_EOS].any():   # ignore_eos rows never sample EOS
                eos = self._eos_tensor()
                logits[:, eos] = logits[:, eos].masked_fill(params.dev[:, MASK_EOS, None] > 0, float("-inf"))
            if batch.num_constrained:   # structured output: constrained rows' masks, on the device
                rows, matchers = batch.constrained(slots)
                if len(rows):
                    self.grammars.apply_masks(logits, rows, matchers)
            tokens = sample(logits, params, self.shared_generator)
            if batch.penalties.num_active:   # the sampled ids join their rows' counts
                batch.penalties.record(slots, tokens)
            batch.bias.advance(slots)
            if asked is not None:
                ids, self.last_logprobs = self.logprobs.finish(asked, tokens)
                return ids
        return tokens.tolist()

    @staticmethod
    def _prompt_rows(logits: torch.Tensor, asks: list[tuple[Sequence, int, int]]) -> list[tuple[Sequence, list]]:
        """Prompt logprobs of this step's chunks, per asking request its rows in position order."""
        targets = [t for seq, lo, n in asks for t in seq.tokens[lo + 1 : lo + 1 + n]]
        rows = prompt_rows(logits, targets, max(seq.prompt_lp_k for seq, _, _ in asks))
        out, i = [], 0
        for seq, _, n in asks:
            k = seq.prompt_lp_k
            out.append((seq, [(lp, ids[:k], lps[:k]) for lp, ids, lps in rows[i : i + n]]))
            i += n
        return out

    def _eos_tensor(self) -> torch.Tensor:
        ids = frozenset(self.eos_ids)
        if self._eos is None or self._eos[0] != ids:
            self._eos = (ids, long_tensor(sorted(ids), self.device))
        return self._eos[1]

    def _pad(self, start: int, end: int) -> None:
        """Rows [start, end) of a graph step that no request owns: token 0 at position 0, written
        to and read from the scratch block (length 1), so they touch no request's KV."""
        scratch = self.cache.scratch_block
        self._host_np[:TABLE_ROWS + 1, start:end] = ((0,), (0,), (scratch * self.cache.block_size,), (1,),
                                                     (self.batch.pad_row,))

    def _upload(self) -> None:
        """Staged inputs to the device: the batch's rows that changed (sampling parameters, block
        tables) and the whole small index buffer (one contiguous copy)."""
        self.batch.upload()
        if self._dev is self._host:
            return
        self._dev.copy_(self._host, non_blocking=True)
        if self._upload_done is None:
            self._upload_done = torch.cuda.Event()
        self._upload_done.record()

    def _graph_meta(self, rows: int) -> StepMeta:
        """A decode-only step of `rows` rows over the device staging buffers (what a graph captures)."""
        return StepMeta(cache=self.cache, write_rows=self._dev[ROWS, :rows], write_pos=self._dev[POSITIONS, :rows],
                        num_decode=rows, groups=self.groups, dtype=self.dtype, block_tables=self.batch.block_tables,
                        table_rows=self._dev[TABLE_ROWS, :rows], token_lengths=self._dev[LENGTHS, :rows])

    def _decode_layout(self, meta: StepMeta, plan: StepPlan) -> None:
        """Decode rows in plan order (shortest context first). For the row kernel, one block
        table of every row (padded to the longest; each row reads only its own length); else cut
        into segments, each segment's rows with a table padded to its longest row (padding
        blocks are masked out)."""
        bs = self.cache.block_size
        decode = plan.decode
        lengths = [seq.computed + 1 for seq in decode]
        meta.decode_lengths = long_tensor(lengths, self.device)
        if self.row_attention:
            n = blocks_for(max(lengths), bs)
            meta.decode_table = long_tensor(_padded_tables(decode, n), self.device).view(len(decode), n)
            return
        for start, end, longest in decode_segments(lengths):
            n = blocks_for(longest, bs)
            table = _padded_tables(decode[start:end], n)
            meta.segments.append(DecodeSegment(start, end, long_tensor(table, self.device), n * bs))


def _padded_tables(decode: list[Sequence], n: int) -> list[int]:
    """Each row's first `n` blocks, row after row, a shorter row padded with its own first block
    (positions past the row's length are masked out or not read, so any block of its own will do)."""
    table: list[int] = []
    for seq in decode:
        own = seq.blocks[:n]
        table.extend(own)
        table.extend([own[0]] * (n - len(own)))
    return table
