"""Batched per-request sampling: greedy, temperature, top-k, top-p, and per-request seeds.

Randomness comes from one `torch.Generator` per request that draws exactly one vector of
exponential noise per sampled token, so a seeded request produces the same tokens whatever
else shares its batch. Sampling uses the exponential-race form (argmax of p / E, E ~ Exp(1)),
which is a draw from p (as vLLM does it) and stays batched across rows.
"""

from __future__ import annotations

import os

import torch


def make_generator(seed: int | None, device: str) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return gen


def sample(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token id per row of `logits` [R, V]. A row with temperature 0 is greedy (its
    generator is not touched)."""
    greedy_ids = logits.argmax(dim=-1)
    sampled = [i for i, t in enumerate(temperature) if t > 0]
    if not sampled:
        return greedy_ids.tolist()
    idx = torch.tensor(sampled, device=logits.device)
    temps = torch.tensor([temperature[i] for i in sampled], device=logits.device, dtype=torch.float32)
    scores = logits.index_select(0, idx).float() / temps[:, None]
    vocab = scores.shape[-1]
    ks = [top_k[i] if 0 < top_k[i] < vocab else vocab for i in sampled]
    ps = [top_p[i] for i in sampled]
    order = None
    if min(ks) < vocab or min(ps) < 1.0:
        # Work in descending order: top-k keeps the first k, top-p the shortest prefix whose
        # mass reaches p (always at least one token).
        scores, order = scores.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)[None, :]
        drop = rank >= torch.tensor(ks, device=logits.device)[:, None]
        scores = scores.masked_fill(drop, float("-inf"))
        probs = scores.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= torch.tensor(ps, device=logits.device, dtype=torch.float32)[:, None]
        drop[:, 0] = False
        probs = probs.masked_fill(drop, 0.0)
    else:
        probs = scores.softmax(dim=-1)
    noise = torch.stack([torch.empty(vocab, device=logits.device).exponential_(generator=generators[i])
                         for i in sampled])
    choice = (probs / noise).argmax(dim=-1)
    if order is not None:
        choice = order.gather(1, choice[:, None])[:, 0]
    out = greedy_ids.clone()
    out[idx] = choice
    return out.tolist()
