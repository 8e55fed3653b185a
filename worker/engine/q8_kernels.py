"""llama.cpp's way of multiplying by 4- and 8-bit weights on a CPU, for the few-row products of a
decode step: each activation row rounded to 8-bit integers per group of 32, integer dot products
on the CPU's u8 x s8 instructions (AVX512-VNNI, or AVX2), one float scale a group
(q8_kernels.cpp has the layouts and the arithmetic).

Why: one user's decode step is bound by the bytes of weights it reads, on one or two cores.
torch's 4-bit CPU kernel (`_weight_int4pack_mm_for_cpu`) converts every weight to bf16 before it
multiplies and so read SmolLM2's 4-bit projections at ~6.5 GB/s on one core of a Xeon that reads
9.3 GB/s (bench/RESULTS.md, issue 32); the 8-bit head went through it as two 4-bit planes.
Rounding the activations to 8 bits is what llama.cpp does for the same Q4_1/Q8_0 files (its
`q8_1` activations), so this is its arithmetic, not a new approximation of ours; the weights are
exactly the numbers the other kernels multiply by.

The extension is compiled from source on first use and cached by its source's hash
(worker.engine.native). Where it cannot be built or the CPU lacks AVX2, `load()` returns None
and the model keeps torch's kernels.
Whether it runs at all is measured, not assumed: cpu_kernels.py times it against the others.
"""

from __future__ import annotations

import functools
import logging

import torch

from worker.engine import native

log = logging.getLogger(__name__)

NAME = "llm_stream_cpu_kernels"   # one extension with the row kernels (native.py)


@functools.lru_cache(maxsize=1)
def load():
    """The compiled extension (`q4_linear`, `q8_linear`, `instruction_set`), or None where it
    cannot run here (worker.engine.native says why, once)."""
    module = native.load(NAME)
    if module is not None:
        log.info("8-bit activation kernels: %s (%s)", module.instruction_set(), native.build_directory(NAME))
    return module


def fits(in_features: int) -> bool:
    """Whether a layer of `in_features` inputs can run here (whole pairs of groups; built)."""
    return in_features % 64 == 0 and load() is not None


def q4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (contiguous, bf16 or float32) @ w.T for 4-bit w = (q - 8) * scale + zero."""
    return load().q4_linear(x, packed, scales, zeros, bias)


def q8_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] (contiguous, bf16 or float32) @ w.T for 8-bit w = (u - 128) * scale."""
    return load().q8_linear(x, packed, scales)


# ---- the weights in the kernels' layouts -----------------------------------------------------

def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K/2] uint8: per pair of groups (64 inputs), 32 bytes with the
    first group in the low nibbles and the second in the high ones."""
    n, k = q.shape
    pairs = q.to(torch.uint8).view(n, k // 64, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def pack_q8(s: torch.Tensor) -> torch.Tensor:
    """[N, K] values -127..127 -> [N, K] uint8 s + 128."""
    return (s + 128).to(torch.uint8).contiguous()


def reference_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the kernels compute, in plain torch (for tests): x rounded to 8 bits per group of 32
    (scale max|x| / 127, round half to even) times the float weights [N, K], in float64."""
    m, k = x.shape
    groups = x.to(torch.float32).view(m, k // 32, 32)
    d = groups.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(groups * torch.where(d > 0, 1 / d, torch.zeros_like(d))),
                    torch.zeros_like(groups)).clamp(-127, 127)
    return ((q * d).view(m, k).to(torch.float64) @ weight.to(torch.float64).t()).to(x.dtype)
