"""Batched sampling on the logits' device: greedy, temperature, min-p, top-k, top-p, per-request
seeds.

Parameters live per row, not per step. A request's temperature, top-k, top-p, min-p, EOS masking
and generator are written once into a `SamplingTable` row when it takes its row of the runner's
batch (input_batch.py; the device copy is uploaded only when a row changed). A step gathers its
rows by index: one `index_select` on the device, one numpy gather on the host for the decisions
(which rows are greedy, seeded, truncated). So no step builds per-row Python lists or uploads
per-row parameters (vLLM v1's persistent batch keeps sampling parameters the same way).

Unseeded rows are drawn by inverse CDF: one uniform number u per row, and the token is where
u * (kept mass) falls in the cumulative sum of the kept probabilities. That needs one random
number per row, not a noise vector over the whole vocabulary (the exponential race, argmax of
p / E, drew 49k exponentials per row per step: on a CPU that cost more than the forward pass at
16 rows). All unseeded rows draw their uniforms in one call from the engine's shared generator.

Seeded rows keep the exponential race, with one Exp(1) number per vocabulary token drawn from
the request's own `torch.Generator`. A seed promises the same tokens whatever shares the batch
and across a failover continuation, whose logits come from a prefill instead of decode steps
and so differ in the last bits. Under the race a last-bit difference changes the token only
when two tokens' p / E nearly tie; under the inverse CDF it moves every boundary of the running
sum, and a 600-token seeded continuation on a random model diverged every time. So a seeded
token costs a vocabulary of noise; `skip` fast-forwards a continuation by drawing as much.

Top-k and top-p work on a row's most likely tokens (a partial `topk`, not a full sort of the
vocabulary) whenever that provably gives the same kept set: top-k within the width always,
top-p when those tokens hold at least mass p. Widths go up a ladder (`WIDTHS`, then the whole
vocabulary, sorted) only for the rows that need it: on SmolLM2's chat answers at temperature
0.7, the 64 most likely tokens held top-p 0.9's set in 99.7% of rows, at temperature 1.0 and
top-p 0.95 in 60% (1024 tokens: 97%). Greedy picks use `max(dim)`, which on a CPU is 3-4x
faster than `argmax` over a 49k vocabulary (same first-maximum rule).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from worker.engine.host_lists import long_tensor

WIDTHS = (64, 1024)   # candidate tokens top-k / top-p look at, in turn, before sorting the vocabulary
TEMPERATURE, TOP_K, TOP_P, MASK_EOS, SEEDED, MIN_P = range(6)   # columns of a SamplingTable row


def make_generator(seed: int | None, device: str) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return gen


def skip(generator: torch.Generator, tokens: int, vocab: int, device) -> None:
    """Advance a seeded generator past `tokens` sampled tokens (one noise vector each, drawn
    the way `sample` draws it)."""
    for _ in range(tokens):
        torch.empty(vocab, device=device).exponential_(generator=generator)


@dataclass
class RowParams:
    """A step's sampled rows' parameters: `host` [R, 6] (numpy, for decisions), `dev` [R, 6]
    (the same on the logits' device, for the math), and each seeded row's generator by row."""
    host: np.ndarray
    dev: torch.Tensor
    generators: dict[int, torch.Generator]


class SamplingTable:
    """Sampling parameters per row (columns TEMPERATURE, TOP_K (0: none), TOP_P, MASK_EOS,
    SEEDED, MIN_P) and each seeded row's generator, kept on the device."""

    def __init__(self, slots: int, device: torch.device):
        self._host = torch.zeros(slots, 6, dtype=torch.float32)
        self.host = self._host.numpy()
        self.dev = self._host if device.type == "cpu" else self._host.to(device)
        self.generators: list[torch.Generator | None] = [None] * slots
        self._dirty = False

    def write(self, slot: int, temperature: float, top_k: int, top_p: float, mask_eos: bool,
              generator: torch.Generator | None, min_p: float = 0.0) -> None:
        self.host[slot] = (temperature, top_k, top_p, mask_eos, generator is not None, min_p)
        self.generators[slot] = generator
        self._dirty = True

    def clear(self, slot: int) -> None:
        """The row's request left: let go of its generator (the numbers stay until rewritten)."""
        self.generators[slot] = None

    @classmethod
    def of(cls, temperature, top_k, top_p, generators, device, min_p=None) -> "SamplingTable":
        """A table whose row r holds row r of the lists (ignore_eos off), uploaded: for callers
        without requests in rows (tests, benchmarks)."""
        table = cls(len(temperature), torch.device(device))
        for r in range(len(temperature)):
            table.write(r, temperature[r], top_k[r], top_p[r], False, generators[r], min_p[r] if min_p else 0.0)
        table.upload()
        return table

    def upload(self) -> None:
        """The table to the device when a row changed: a plain blocking copy of a few KB, only
        on steps that admitted a request, so the table can be rewritten right after."""
        if self._dirty and self.dev is not self._host:
            self.dev.copy_(self._host)
        self._dirty = False

    def rows(self, slots: np.ndarray, slots_dev: torch.Tensor) -> RowParams:
        """The parameters of rows whose slots are `slots` (host) / `slots_dev` (device)."""
        host = self.host[slots]
        seeded = np.flatnonzero(host[:, SEEDED])
        return RowParams(host, self.dev.index_select(0, slots_dev),
                         {int(r): self.generators[slots[r]] for r in seeded})


def row_params(temperature, top_k, top_p, generators, device, min_p=None) -> RowParams:
    """RowParams from per-row lists, for callers without slots (tests, benchmarks)."""
    slots = np.arange(len(temperature))
    table = SamplingTable.of(temperature, top_k, top_p, generators, device, min_p)
    return table.rows(slots, torch.from_numpy(slots).to(device))


def sample(logits: torch.Tensor, rows: RowParams, shared: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of `logits` [R, V], as a long tensor on the logits' device. A row
    with temperature 0 is greedy (draws nothing). A sampled row with its own generator races
    its noise; the others draw a uniform each from `shared`."""
    host = rows.host
    sampled = host[:, TEMPERATURE] > 0
    if not sampled.any():
        return logits.max(dim=-1).indices
    seeded = sampled & (host[:, SEEDED] > 0)
    groups = [(mask, draw) for mask, draw in ((sampled & ~seeded, _by_inverse_cdf), (seeded, _by_race))
              if mask.any()]
    choice = None if sampled.all() else logits.max(dim=-1).indices
    for mask, draw in groups:
        if mask.all():   # one group holds every row: no copies
            return draw(_probs(logits, host, rows.dev), host, rows.dev, rows.generators, shared)
        picked = np.flatnonzero(mask)
        idx = long_tensor(picked, logits.device)
        dev = rows.dev.index_select(0, idx)
        gens = {i: rows.generators[int(r)] for i, r in enumerate(picked)} if draw is _by_race else {}
        part = draw(_probs(logits.index_select(0, idx), host[picked], dev), host[picked], dev, gens, shared)
        if choice is None:
            choice = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        choice.index_copy_(0, idx, part)
    return choice


def _probs(logits: torch.Tensor, host: np.ndarray, dev: torch.Tensor) -> torch.Tensor:
    """Softmax at each row's temperature; min-p (vLLM's, after temperature) drops the tokens less
    likely than min_p times the row's most likely one and renormalizes (rows without: untouched,
    to the last bit)."""
    probs = (logits.float() / dev[:, TEMPERATURE, None]).softmax(dim=-1)
    if not host[:, MIN_P].any():
        return probs
    min_p = dev[:, MIN_P, None]
    kept = probs.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p, 0.0)
    return torch.where(min_p > 0, kept / kept.sum(dim=-1, keepdim=True), probs)


def _is_cut(host: np.ndarray, vocab: int) -> np.ndarray:
    """Rows whose top-k or top-p removes tokens."""
    k = host[:, TOP_K]
    return ((k > 0) & (k < vocab)) | (host[:, TOP_P] < 1.0)


def _by_inverse_cdf(probs: torch.Tensor, host: np.ndarray, dev: torch.Tensor, _generators, shared) -> torch.Tensor:
    uniform = torch.empty(probs.shape[0], device=probs.device).uniform_(generator=shared)
    cut = _is_cut(host, probs.shape[-1])
    if not cut.any():
        return _inverse_cdf(probs, uniform)
    if cut.all():
        return _truncated(probs, uniform, host, dev)
    choice = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    for rows, fn in ((np.flatnonzero(~cut), None), (np.flatnonzero(cut), _truncated)):
        idx = long_tensor(rows, probs.device)
        p, u = probs.index_select(0, idx), uniform.index_select(0, idx)
        choice.index_copy_(0, idx, _inverse_cdf(p, u) if fn is None else fn(p, u, host[rows], dev.index_select(0, idx)))
    return choice


def _by_race(probs: torch.Tensor, host: np.ndarray, dev: torch.Tensor, generators: dict[int, torch.Generator],
             _shared) -> torch.Tensor:
    """argmax of kept p / E with E indexed by token id (not by rank, which a near tie could
    reorder), one noise vector per row from the row's own generator."""
    noise = torch.empty_like(probs)
    for row in range(probs.shape[0]):
        noise[row].exponential_(generator=generators[row])
    if _is_cut(host, probs.shape[-1]).any():
        probs = _kept(probs, host, dev)
    return (probs / noise).max(dim=-1).indices


def _kept(probs: torch.Tensor, host: np.ndarray, dev: torch.Tensor) -> torch.Tensor:
    """`probs` with every token outside its row's top-k / top-p set zeroed."""
    kept = None
    for redo, vals, order in _cut_stages(probs, host, dev):
        part = torch.zeros(vals.shape[0], probs.shape[-1], dtype=vals.dtype, device=vals.device).scatter_(1, order, vals)
        if redo is None:
            kept = part
        else:
            kept[redo] = part
    return kept


def _truncated(probs: torch.Tensor, uniform: torch.Tensor, host: np.ndarray, dev: torch.Tensor) -> torch.Tensor:
    """Sample rows under top-k (keep the k most likely) then top-p (of those, keep the shortest
    prefix whose renormalized mass reaches p; at least one token)."""
    choice = None
    for redo, vals, order in _cut_stages(probs, host, dev):
        u = uniform if redo is None else uniform.index_select(0, redo)
        pick = order.gather(1, _inverse_cdf(vals, u)[:, None])[:, 0]
        if redo is None:
            choice = pick
        else:
            choice[redo] = pick
    return choice


def _cut_stages(probs: torch.Tensor, host: np.ndarray, dev: torch.Tensor):
    """Top-k / top-p of every row, as (rows, kept probabilities, their token ids) stages: first
    all rows (rows None) over the first width, then only the rows that width could not settle,
    over the next, up to the whole vocabulary sorted (which settles every row)."""
    vocab = probs.shape[-1]
    k = host[:, TOP_K]
    topk_max = int(k[(k > 0) & (k < vocab)].max(initial=0))
    first = min(vocab, max(WIDTHS[0], topk_max))   # every top-k fits the first width
    widths = [first] + [w for w in WIDTHS if first < w < vocab] + ([vocab] if first < vocab else [])
    k_t = dev[:, TOP_K, None]
    k_t = torch.where((k_t > 0) & (k_t < vocab), k_t, torch.full_like(k_t, vocab))
    p_t = dev[:, TOP_P, None]
    redo = None
    for i, width in enumerate(widths):
        if redo is None:
            vals, order, exact = _truncated_within(probs, k_t, p_t, width)
        else:
            vals, order, exact = _truncated_within(probs.index_select(0, redo), k_t.index_select(0, redo),
                                                   p_t.index_select(0, redo), width)
        yield redo, vals, order
        if i + 1 == len(widths) or bool(exact.all()):
            return
        left = (~exact).nonzero()[:, 0]
        redo = left if redo is None else redo.index_select(0, left)


def _truncated_within(probs: torch.Tensor, k_t: torch.Tensor, p_t: torch.Tensor,
                      width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k / top-p over each row's `width` most likely tokens: their probabilities with the
    dropped ones zeroed, their token ids, and per row whether that was exact: its top-k lies
    within them (k <= width; k = vocabulary size means none), or, without a top-k, its top-p
    prefix ended inside them."""
    device = probs.device
    vocab = probs.shape[-1]
    vals, order = probs.topk(width, dim=-1) if width < vocab else probs.sort(dim=-1, descending=True)
    vals = vals.masked_fill(torch.arange(width, device=device)[None, :] >= k_t, 0.0)
    # top-k's mass when it has a top-k (always within `width`), else the whole distribution's
    has_k = k_t < vocab
    total = torch.where(has_k, vals.sum(dim=-1, keepdim=True), torch.ones_like(p_t))
    drop = (vals.cumsum(dim=-1) - vals) >= p_t * total
    drop[:, 0] = False
    exact = torch.where(has_k[:, 0], k_t[:, 0] <= width, drop.any(dim=-1)) | (width >= vocab)
    return vals.masked_fill(drop, 0.0), order, exact


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the index where uniform * total falls in the running sum of `weights` (>= 0,
    unnormalized). Entries of weight 0 are never chosen: the running sum does not rise there."""
    cdf = weights.cumsum(dim=-1)
    target = (uniform * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=weights.shape[-1] - 1)
