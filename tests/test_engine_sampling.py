"""The sampler on its own: every row draws from exactly the distribution its parameters define
(temperature, top-k, top-p, both), unseeded (inverse CDF) and seeded (race), whether top-k/top-p
settle within the first candidate width, need a wider one or fall back to sorting the
vocabulary, in mixed batches; seeded rows do not depend on their batch nor on last-bit
differences in their logits; parameters come from per-slot rows written once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.engine import sampling
from worker.engine.sampling import make_generator, row_params, sample, skip

V = 64
DRAWS = 40_000


def draw(logits, temperature, top_k, top_p, generators, shared=None):
    return sample(logits, row_params(temperature, top_k, top_p, generators, "cpu"), shared)


def logits_row(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 2


def expected(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The target distribution, computed the plain way in float64 (full sort)."""
    probs = (logits.double() / temperature).softmax(-1)
    vals, order = probs.sort(descending=True)
    k = top_k if 0 < top_k < V else V
    vals[k:] = 0
    vals = vals / vals.sum()
    before = vals.cumsum(-1) - vals
    keep = before < top_p
    keep[0] = True
    vals = vals * keep
    out = torch.zeros(V, dtype=torch.float64)
    out[order] = vals / vals.sum()
    return out


def empirical(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, rows: int = 4000,
              seeded: bool = False) -> torch.Tensor:
    shared = make_generator(1, "cpu")
    gens = [make_generator(seed, "cpu") for seed in range(rows)] if seeded else [None] * rows
    counts = torch.zeros(V, dtype=torch.float64)
    batch = logits[None].expand(rows, V).contiguous()
    for _ in range(DRAWS // rows):
        ids = draw(batch, [temperature] * rows, [top_k] * rows, [top_p] * rows, gens, shared)
        counts += torch.bincount(ids, minlength=V).double()
    return counts / counts.sum()


@pytest.mark.parametrize("seeded", [False, True], ids=["shared", "seeded"])
@pytest.mark.parametrize("widths", [sampling.WIDTHS, (4, 8)], ids=["whole-vocab", "4-then-8-candidates"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8),
                                                     (0.9, 12, 0.6), (2.0, 0, 0.97)])
def test_each_row_draws_from_its_distribution(monkeypatch, widths, temperature, top_k, top_p, seeded):
    """Total variation distance to the target below 0.03 over 40k draws; tokens outside the
    kept set never appear. With widths 4 then 8, top-p rows are settled at 4, 8 or by the full
    sort (top-p 0.97 at temperature 2 needs more than 8), and top-k 12 widens the first width."""
    monkeypatch.setattr(sampling, "WIDTHS", widths)
    logits = logits_row()
    want = expected(logits, temperature, top_k, top_p)
    got = empirical(logits, temperature, top_k, top_p, seeded=seeded)
    assert got[want == 0].sum() == 0
    assert 0.5 * (got - want).abs().sum() < 0.03


def test_a_flat_top_p_needs_the_fallback_and_gets_it(monkeypatch):
    """A flat distribution whose top-p set is larger than the candidates: tokens beyond the
    candidates are drawn (so the kept set was not cut at the candidates) and none outside it."""
    monkeypatch.setattr(sampling, "WIDTHS", (4, 8))
    logits = torch.linspace(0, -0.5, V)   # nearly flat, sorted: token i is the i-th most likely
    want = expected(logits, 1.0, 0, 0.9)
    kept = int((want > 0).sum())
    assert kept > 40
    for seeded in (False, True):
        got = empirical(logits, 1.0, 0, 0.9, seeded=seeded)
        assert got[kept:].sum() == 0 and got[8:kept].sum() > 0.5
        assert 0.5 * (got - want).abs().sum() < 0.03


@pytest.mark.timeout(900)     # CPU-bound sampling statistics: minutes when it shares a busy box
def test_a_mixed_batch_keeps_every_row_to_its_own_parameters(monkeypatch):
    """Greedy, plain, top-k and top-p rows, unseeded and seeded, in one batch."""
    monkeypatch.setattr(sampling, "WIDTHS", (4, 8))
    params = [(0.0, 0, 1.0), (1.0, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.5)] * 2
    rows = [logits_row(s) for s in range(len(params))]
    gens = [None] * 4 + [make_generator(s, "cpu") for s in range(4)]
    counts = [torch.zeros(V) for _ in rows]
    shared = make_generator(3, "cpu")
    batch = torch.stack(rows)
    for _ in range(3000):
        ids = draw(batch, [p[0] for p in params], [p[1] for p in params], [p[2] for p in params],
                     gens, shared)
        for r, i in enumerate(ids.tolist()):
            counts[r][i] += 1
    assert counts[0][rows[0].argmax()] == 3000 and counts[4][rows[4].argmax()] == 3000   # greedy
    for r, (t, k, p) in enumerate(params):
        if t == 0:
            continue
        want = expected(rows[r], t, k, p)
        got = counts[r].double() / 3000
        assert got[want == 0].sum() == 0
        assert 0.5 * (got - want).abs().sum() < 0.06


def test_a_seeded_row_does_not_depend_on_its_batch_and_skip_fast_forwards_it():
    row = logits_row(7)

    def run(batch_size: int, position: int, skipped: int = 0) -> list[int]:
        gen = make_generator(1234, "cpu")
        skip(gen, skipped, V, "cpu")
        others = torch.randn(batch_size, V, generator=torch.Generator().manual_seed(batch_size))
        out = []
        for _ in range(30):
            batch = others.clone()
            batch[position] = row
            gens = [None] * batch_size
            gens[position] = gen
            ids = draw(batch, [0.8] * batch_size, [0] * batch_size, [0.9] * batch_size, gens,
                         make_generator(None, "cpu"))
            out.append(int(ids[position]))
        return out

    alone = run(1, 0)
    assert run(5, 3) == alone and run(17, 0) == alone
    assert run(4, 2, skipped=10)[:20] == alone[10:]


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (40, 0.9)], ids=["plain", "top-k+top-p"])
def test_a_seeded_row_ignores_last_bit_differences_in_its_logits(top_k, top_p):
    """A failover continuation recomputes a seeded request's logits by prefill, which rounds
    differently from decode steps. A relative change of 1e-6 must not change its tokens (the
    race changes a token only at a near tie of p / E), while it does move unseeded draws
    (inverse CDF), which promise nothing across runs: the check is sensitive."""
    vocab, rows, steps = 49_152, 16, 12
    moved = 0
    for step in range(steps):
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(step)) * 5
        nudged = logits * (1 + 1e-6 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(99)))
        assert not torch.equal(logits.softmax(-1), nudged.softmax(-1))
        params = ([1.0] * rows, [top_k] * rows, [top_p] * rows)
        seeded = [draw(x, *params, [make_generator(1000 * step + r, "cpu") for r in range(rows)])
                  for x in (logits, nudged)]
        assert torch.equal(seeded[0], seeded[1]), step
        unseeded = [draw(x, *params, [None] * rows, make_generator(step, "cpu")) for x in (logits, nudged)]
        moved += int((unseeded[0] != unseeded[1]).sum())
    if top_k == 0:   # over the whole vocabulary the running sum moves enough to change some draws
        assert moved > 0


@pytest.mark.parametrize("seeded", [False, True], ids=["shared", "seeded"])
def test_only_the_rows_a_width_cannot_settle_go_wider(monkeypatch, seeded):
    """One batch whose top-p sets need 3, 6 and ~50 tokens, with widths 4 then 8: all three
    rows go through width 4, the two it cannot settle through 8, the flat one alone through the
    sorted vocabulary; each still draws from its own distribution."""
    monkeypatch.setattr(sampling, "WIDTHS", (4, 8))
    flat = torch.linspace(0, -0.5, V)
    peaked = flat.clone()
    peaked[:3] += 6.0
    middle = flat.clone()
    middle[:6] += 6.0
    batch = torch.stack([peaked, middle, flat])
    wants = [expected(row, 1.0, 0, 0.9) for row in batch]
    assert [int((w > 0).sum()) for w in wants][:2] == [3, 6] and int((wants[2] > 0).sum()) > 40
    seen = []
    within = sampling._truncated_within
    monkeypatch.setattr(sampling, "_truncated_within",
                        lambda probs, k, p, width: seen.append((probs.shape[0], width)) or within(probs, k, p, width))
    draw(batch, [1.0] * 3, [0] * 3, [0.9] * 3, [make_generator(1, "cpu") if seeded else None] * 3,
         make_generator(2, "cpu"))
    assert seen == [(3, 4), (2, 8), (1, V)]
    monkeypatch.setattr(sampling, "_truncated_within", within)
    reps = 3000
    counts = torch.zeros(3, V, dtype=torch.float64)
    big = batch.repeat(reps // 3, 1)
    gens = [make_generator(s, "cpu") for s in range(big.shape[0])] if seeded else [None] * big.shape[0]
    shared = make_generator(3, "cpu")
    for _ in range(12):
        ids = draw(big, [1.0] * big.shape[0], [0] * big.shape[0], [0.9] * big.shape[0], gens, shared)
        for r in range(3):
            counts[r] += torch.bincount(ids[r::3], minlength=V).double()
    for r in range(3):
        got = counts[r] / counts[r].sum()
        assert got[wants[r] == 0].sum() == 0
        assert 0.5 * (got - wants[r]).abs().sum() < 0.04


@pytest.mark.parametrize("seeded", [False, True], ids=["shared", "seeded"])
@pytest.mark.parametrize("temperature,min_p,top_k,top_p", [(1.0, 0.1, 0, 1.0), (1.5, 0.3, 0, 0.8), (0.8, 0.25, 6, 1.0)])
def test_min_p_rows_draw_from_their_distribution_beside_rows_without(temperature, min_p, top_k, top_p, seeded):
    """vLLM's min-p, after temperature, before top-k / top-p: tokens less likely than min_p times
    the most likely one are dropped, the rest renormalized. Rows without min-p in the same batch
    (every tenth) draw exactly what they draw without such neighbours."""
    logits = logits_row(3)
    probs = (logits.double() / temperature).softmax(-1)
    kept = torch.where(probs >= min_p * probs.max(), logits.double(), torch.tensor(float("-inf"), dtype=torch.float64))
    want = expected(kept, temperature, top_k, top_p)
    assert 0 < int((want > 0).sum()) < int((expected(logits, temperature, top_k, top_p) > 0).sum())
    rows = 2000
    plain = np.arange(rows) % 10 == 9
    batch = logits[None].expand(rows, V).contiguous()
    counts = torch.zeros(V, dtype=torch.float64)
    shared = make_generator(4, "cpu")
    for i in range(DRAWS // int((~plain).sum()) + 1):
        gens = [make_generator(1000 * i + s, "cpu") for s in range(rows)] if seeded else [None] * rows
        params = row_params([temperature] * rows, [top_k] * rows, [top_p] * rows, gens, "cpu",
                            min_p=np.where(plain, 0.0, min_p).tolist())
        ids = sample(batch, params, shared)
        counts += torch.bincount(ids[torch.from_numpy(~plain)], minlength=V).double()
        if seeded and i == 0:   # a row without min-p: the same draws as in a batch without any
            picked = np.flatnonzero(plain)
            alone = draw(batch[picked], [temperature] * len(picked), [top_k] * len(picked), [top_p] * len(picked),
                         [make_generator(int(s), "cpu") for s in picked])
            assert torch.equal(ids[torch.from_numpy(plain)], alone)
    got = counts / counts.sum()
    assert got[want == 0].sum() == 0
    assert 0.5 * (got - want).abs().sum() < 0.03


def test_min_p_1_is_greedy():
    batch = torch.stack([logits_row(s) for s in range(8)])
    ids = sample(batch, row_params([1.5] * 8, [0] * 8, [1.0] * 8, [None] * 4 + [make_generator(s, "cpu") for s in range(4)],
                                   "cpu", min_p=[1.0] * 8), make_generator(1, "cpu"))
    assert torch.equal(ids, batch.argmax(-1))
