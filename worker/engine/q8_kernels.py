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

The extension is compiled from source on first use with torch's own toolchain helper (a C++
compiler and ninja; `python -m worker.engine.q8_kernels` builds it ahead, as scripts/setup.sh
and the worker image do) and cached by its source's hash. Where it cannot be built or the CPU
lacks AVX2, `load()` says why once and returns None, and the model keeps torch's kernels.
Whether it runs at all is measured, not assumed: cpu_kernels.py times it against the others.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

from worker.engine.cpu_kernels import cpu_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("q8_kernels.cpp")
NAME = "llm_stream_q8_kernels"
CFLAGS = ["-O3", "-fopenmp"]   # OpenMP: at::parallel_for splits rows over torch's threads (its libgomp)


def build_directory() -> Path:
    """Where this source's build lives: `Q8_KERNELS_DIR` (default: torch's extensions directory,
    `TORCH_EXTENSIONS_DIR` or ~/.cache/torch_extensions), in a folder named by a hash of the
    source, the flags and the torch and Python versions, so a changed kernel is rebuilt and a
    built one is imported as it is (no compiler, no lock file: a read-only image works)."""
    import hashlib
    import sys
    configured = os.environ.get("Q8_KERNELS_DIR")
    if configured:
        base = Path(configured)
    else:
        from torch.utils.cpp_extension import get_default_build_root
        base = Path(get_default_build_root())
    key = hashlib.sha256(SOURCE.read_bytes() + repr((CFLAGS, torch.__version__, sys.version_info[:2])).encode())
    return base / f"{NAME}-{key.hexdigest()[:12]}"


@functools.lru_cache(maxsize=1)
def load():
    """The compiled extension (`q4_linear`, `q8_linear`, `instruction_set`), or None where it
    cannot run here (logged once with the reason)."""
    flags = cpu_flags()
    if not {"avx2", "fma"} <= flags:
        log.info("8-bit activation kernels: off (this CPU has no AVX2+FMA)")
        return None
    directory = build_directory()
    try:
        from torch.utils import cpp_extension
        built = directory / f"{NAME}.so"
        if built.exists():
            module = cpp_extension._import_module_from_library(NAME, str(directory), True)
        else:
            directory.mkdir(parents=True, exist_ok=True)
            log.info("8-bit activation kernels: compiling %s into %s (once, ~1 min)", SOURCE.name, directory)
            module = cpp_extension.load(name=NAME, sources=[str(SOURCE)], extra_cflags=CFLAGS,
                                        extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
    except Exception as error:  # no compiler, no ninja, a read-only cache: torch's kernels run instead
        text = str(error).strip()
        log.warning("8-bit activation kernels: off (could not build %s in %s: %s)", SOURCE.name, directory,
                    text.splitlines()[-1] if text else type(error).__name__)
        return None
    log.info("8-bit activation kernels: %s (%s)", module.instruction_set(), directory)
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


if __name__ == "__main__":   # build ahead of the first worker start
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    raise SystemExit(0 if load() is not None else 1)
