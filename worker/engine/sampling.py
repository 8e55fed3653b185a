"""Batched sampling on the logits' device: greedy, temperature, top-k, top-p, per-request seeds.

Sampling uses the exponential-race form (argmax of p / E, E ~ Exp(1)), which is a draw from p
(as vLLM does it) and stays batched across rows: temperatures, top-k and top-p are per-row
tensors, and greedy rows are picked with a `where`, so no step loops over rows on the device.
The only per-row work is noise for seeded requests: each has its own `torch.Generator` that
draws exactly one vector of noise per sampled token, so a seeded request produces the same
tokens whatever else shares its batch (and a continuation can fast-forward it, see `skip`).
Unseeded rows draw their noise in one call from the engine's shared generator.
"""

from __future__ import annotations

import os

import torch


def make_generator(seed: int | None, device: str) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return gen


def skip(generator: torch.Generator, tokens: int, vocab: int, device) -> None:
    """Advance a seeded generator past `tokens` sampled tokens (one noise vector each)."""
    for _ in range(tokens):
        torch.empty(vocab, device=device).exponential_(generator=generator)


def sample(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
           generators: list[torch.Generator | None], shared: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of `logits` [R, V], as a long tensor on the logits' device. A row
    with temperature 0 is greedy (no noise is drawn for it). A sampled row draws its noise from
    its own generator, or from `shared` when it has none."""
    greedy_ids = logits.argmax(dim=-1)
    sampled = [i for i, t in enumerate(temperature) if t > 0]
    if not sampled:
        return greedy_ids
    device = logits.device
    idx = torch.tensor(sampled, device=device)
    temps = torch.tensor([temperature[i] for i in sampled], device=device, dtype=torch.float32)
    scores = logits.index_select(0, idx).float() / temps[:, None]
    vocab = scores.shape[-1]
    ks = [top_k[i] if 0 < top_k[i] < vocab else vocab for i in sampled]
    ps = [top_p[i] for i in sampled]
    order = None
    if min(ks) < vocab or min(ps) < 1.0:
        # Work in descending order: top-k keeps the first k, top-p the shortest prefix whose
        # mass reaches p (always at least one token).
        scores, order = scores.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)[None, :]
        scores = scores.masked_fill(rank >= torch.tensor(ks, device=device)[:, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= torch.tensor(ps, device=device, dtype=torch.float32)[:, None]
        drop[:, 0] = False
        probs = probs.masked_fill(drop, 0.0)
    else:
        probs = scores.softmax(dim=-1)
    noise = torch.empty(len(sampled), vocab, device=device)
    own = [row for row, i in enumerate(sampled) if generators[i] is not None]
    if len(own) < len(sampled):
        noise.exponential_(generator=shared)
    for row in own:
        noise[row].exponential_(generator=generators[sampled[row]])
    choice = (probs / noise).argmax(dim=-1)
    if order is not None:
        choice = order.gather(1, choice[:, None])[:, 0]
    return greedy_ids.index_put((idx,), choice)
