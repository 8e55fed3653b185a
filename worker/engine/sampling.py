"""Batched sampling on the logits' device: greedy, temperature, top-k, top-p, per-request seeds.

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

Temperatures, top-k and top-p are per-row tensors and greedy rows are picked with an
index_put, so no step loops over rows on the device except to draw a seeded row's noise.
Top-k and top-p work on the `CANDIDATES` most likely tokens (a partial `topk`, not a full sort
of the vocabulary) whenever that provably gives the same kept set: top-k with k <= CANDIDATES
always, top-p when the candidates hold at least mass p. A row whose top-p needs more (a very
flat distribution) is done again over the whole vocabulary, sorted.
"""

from __future__ import annotations

import os

import torch

from worker.engine.host_lists import float_tensor, long_tensor

CANDIDATES = 1024   # tokens top-k / top-p look at before falling back to a full sort


def make_generator(seed: int | None, device: str) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return gen


def skip(generator: torch.Generator, tokens: int, vocab: int, device) -> None:
    """Advance a seeded generator past `tokens` sampled tokens (one noise vector each, drawn
    the way `sample` draws it)."""
    for _ in range(tokens):
        torch.empty(vocab, device=device).exponential_(generator=generator)


def sample(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
           generators: list[torch.Generator | None], shared: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of `logits` [R, V], as a long tensor on the logits' device. A row
    with temperature 0 is greedy (draws nothing). A sampled row with its own generator races
    its noise; the others draw a uniform each from `shared`."""
    greedy_ids = logits.argmax(dim=-1)
    sampled = [i for i, t in enumerate(temperature) if t > 0]
    if not sampled:
        return greedy_ids
    device = logits.device
    vocab = logits.shape[-1]
    seeded = [i for i in sampled if generators[i] is not None]
    unseeded = [i for i in sampled if generators[i] is None] if seeded else sampled
    for rows, draw in ((unseeded, _by_inverse_cdf), (seeded, _by_race)):
        if not rows:
            continue
        idx = long_tensor(rows, device)
        temps = float_tensor([temperature[i] for i in rows], device)
        probs = (logits.index_select(0, idx).float() / temps[:, None]).softmax(dim=-1)
        ks = [top_k[i] if 0 < top_k[i] < vocab else vocab for i in rows]
        ps = [top_p[i] for i in rows]
        choice = draw(probs, ks, ps, [generators[i] for i in rows], shared)
        greedy_ids = greedy_ids.index_put((idx,), choice)
    return greedy_ids


def _by_inverse_cdf(probs: torch.Tensor, ks: list[int], ps: list[float], _generators, shared) -> torch.Tensor:
    uniform = torch.empty(probs.shape[0], device=probs.device).uniform_(generator=shared)
    vocab = probs.shape[-1]
    is_cut = [k < vocab or p < 1.0 for k, p in zip(ks, ps)]
    if not any(is_cut):
        return _inverse_cdf(probs, uniform)
    if all(is_cut):
        return _truncated(probs, uniform, ks, ps)
    truncated = [row for row, c in enumerate(is_cut) if c]
    plain = [row for row, c in enumerate(is_cut) if not c]
    cut, whole = long_tensor(truncated, probs.device), long_tensor(plain, probs.device)
    choice = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    choice[whole] = _inverse_cdf(probs.index_select(0, whole), uniform.index_select(0, whole))
    choice[cut] = _truncated(probs.index_select(0, cut), uniform.index_select(0, cut),
                             [ks[r] for r in truncated], [ps[r] for r in truncated])
    return choice


def _by_race(probs: torch.Tensor, ks: list[int], ps: list[float], generators: list[torch.Generator],
             _shared) -> torch.Tensor:
    """argmax of kept p / E with E indexed by token id (not by rank, which a near tie could
    reorder), one noise vector per row from the row's own generator."""
    noise = torch.empty_like(probs)
    for row, gen in enumerate(generators):
        noise[row].exponential_(generator=gen)
    vocab = probs.shape[-1]
    if any(k < vocab or p < 1.0 for k, p in zip(ks, ps)):
        probs = _kept(probs, ks, ps)
    return (probs / noise).argmax(dim=-1)


def _kept(probs: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """`probs` with every token outside its row's top-k / top-p set zeroed."""
    vocab = probs.shape[-1]
    width = min(vocab, max([CANDIDATES] + [k for k in ks if k < vocab]))
    vals, order, exact = _truncated_within(probs, ks, ps, width)
    kept = torch.zeros_like(probs).scatter_(1, order, vals)
    if width < vocab and not bool(exact.all()):
        redo = (~exact).nonzero()[:, 0]
        rows = redo.tolist()
        vals, order, _ = _truncated_within(probs.index_select(0, redo), [ks[r] for r in rows],
                                           [ps[r] for r in rows], vocab)
        kept[redo] = torch.zeros_like(vals).scatter_(1, order, vals)
    return kept


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the index where uniform * total falls in the running sum of `weights` (>= 0,
    unnormalized). Entries of weight 0 are never chosen: the running sum does not rise there."""
    cdf = weights.cumsum(dim=-1)
    target = (uniform * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=weights.shape[-1] - 1)


def _truncated(probs: torch.Tensor, uniform: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """Sample rows under top-k (keep the k most likely) then top-p (of those, keep the shortest
    prefix whose renormalized mass reaches p; at least one token). Rows whose kept set does not
    fit in the candidates are done again over the whole vocabulary, sorted."""
    vocab = probs.shape[-1]
    width = min(vocab, max([CANDIDATES] + [k for k in ks if k < vocab]))
    vals, order, exact = _truncated_within(probs, ks, ps, width)
    choice = order.gather(1, _inverse_cdf(vals, uniform)[:, None])[:, 0]
    if width < vocab and not bool(exact.all()):
        redo = (~exact).nonzero()[:, 0]
        rows = redo.tolist()
        vals, order, _ = _truncated_within(probs.index_select(0, redo), [ks[r] for r in rows],
                                           [ps[r] for r in rows], vocab)
        choice[redo] = order.gather(1, _inverse_cdf(vals, uniform.index_select(0, redo))[:, None])[:, 0]
    return choice


def _truncated_within(probs: torch.Tensor, ks: list[int], ps: list[float],
                      width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k / top-p over each row's `width` most likely tokens: their probabilities with the
    dropped ones zeroed, their token ids, and per row whether that was exact: its top-k lies
    within them (k <= width), or its top-p prefix ended inside them."""
    device = probs.device
    vocab = probs.shape[-1]
    k_t = long_tensor(ks, device)[:, None]
    p_t = float_tensor(ps, device)[:, None]
    vals, order = probs.topk(width, dim=-1) if width < vocab else probs.sort(dim=-1, descending=True)
    vals = vals.masked_fill(torch.arange(width, device=device)[None, :] >= k_t, 0.0)
    # top-k's mass when it has a top-k (always within `width`), else the whole distribution's
    total = torch.where(k_t < vocab, vals.sum(dim=-1, keepdim=True), torch.ones_like(p_t))
    drop = (vals.cumsum(dim=-1) - vals) >= p_t * total
    drop[:, 0] = False
    exact = drop.any(dim=-1) | (k_t[:, 0] <= width)
    return vals.masked_fill(drop, 0.0), order, exact
