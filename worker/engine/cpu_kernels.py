"""Which kernel runs a 4-bit model's products on this CPU, by their size: measured at start.

A decode step of a few rows is bound by the bytes of weights it reads, and there the packed
kernels win (4-bit projections, the 8-bit head: a quarter and half of bf16's bytes). Past a few
rows a product is arithmetic, and they lose: they unpack every weight for every row, where the
CPU's own dense kernels (oneDNN: AVX-512 BF16, AMX) stream a dense copy. On a 2-core EPYC
without AMX (1 thread, bf16) the whole model's projections took 1.4x as long packed as dense at
16 rows and 2.3x at 256 (a prefill chunk); where the crossover lies depends on the CPU (AMX
moves it down, an AVX2-only CPU with emulated bf16 may never cross), on the threads and on the
cache, so it is not assumed: `calibrate_projections` times the model's own projections, every
one once per run (more bytes than any last-level cache, as a real step reads them), and
`calibrate_head` the head between such passes. Each logs what it measured and chose, with the
CPU model: bench/RESULTS.md records those lines with the speeds they gave.

Exactness: the dense copy holds the numbers the packed kernel multiplies by (read back through
it), so both compute the same products and differ in rounding only; a row's result depends on
the size of the product it is in (as on every batched GPU engine), which may move a token at an
exact tie between, say, a chunked prefill and `generate`'s one pass (tests/test_engine_smollm2).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64)   # decode rows .. a large batch; a prefill chunk (256) is past the last
WIN = 0.9                                # dense must take at most this share of the packed kernel's time


def crossover(timings: dict[int, tuple[float, float]]) -> int:
    """The smallest row count at which dense wins (by WIN) there and at every larger count
    timed, from {rows: (packed ms, dense ms)}; 0 if it does not win at the largest."""
    from_rows = 0
    for rows in sorted(timings, reverse=True):
        packed_ms, dense_ms = timings[rows]
        if dense_ms > WIN * packed_ms:
            break
        from_rows = rows
    return from_rows


def _best_of(fns: list[Callable[[], object]], repeats: int,
             before: Callable[[], object] | None = None) -> list[float]:
    """Milliseconds of each of `fns`, the best of `repeats` runs (after one untimed), the
    functions timed alternately (a VM's neighbours move a core's speed by tens of percent within
    a second: alternation gives each the same luck), `before` run untimed ahead of each run (e.g.
    to push the weights out of the cache)."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(repeats + 1):
        for fn, into in zip(fns, times):
            if before is not None:
                before()
            t = time.perf_counter()
            fn()
            if i:
                into.append(time.perf_counter() - t)
    return [1000 * min(each) for each in times]


def _best(fn: Callable[[], object], repeats: int, before: Callable[[], object] | None = None) -> float:
    return _best_of([fn], repeats, before)[0]


def calibrate_projections(linears: list, int4_linear: Callable, dtype: torch.dtype, repeats: int = 2,
                          row_counts: tuple[int, ...] = ROW_COUNTS) -> int:
    """The row count from which the model's projections (`Int4Linear`s that hold their `dense`
    copies) should run dense: every projection once per timed run, packed (`int4_linear`, the
    quantize module's product) vs dense."""
    generator = torch.Generator().manual_seed(0)
    timings: dict[int, tuple[float, float]] = {}
    with torch.inference_mode():
        for rows in row_counts:
            xs = {n: torch.randn(rows, n, generator=generator).to(dtype) for n in {q.in_features for q in linears}}
            packed = lambda: [int4_linear(xs[q.in_features], q.packed, q.scales_zeros) for q in linears]  # noqa: E731
            dense = lambda: [F.linear(xs[q.in_features], q.dense) for q in linears]  # noqa: E731
            timings[rows] = (_best(packed, repeats), _best(dense, repeats))
    chosen = crossover(timings)
    log.info("CPU kernels on %s, %d threads: %s (the model's %d projections, rows: 4-bit/dense ms: %s)",
             cpu_model(), torch.get_num_threads(),
             f"dense from {chosen} rows, 4-bit below" if chosen else "4-bit at every size", len(linears),
             _shown(timings))
    return chosen


def calibrate_head(head, dense_weight: torch.Tensor, linears: list, int4_linear: Callable, dtype: torch.dtype,
                   repeats: int = 2, row_counts: tuple[int, ...] = ROW_COUNTS) -> int:
    """The row count from which an 8-bit head (`Int8SplitLinear`) should multiply by the dense
    table instead, each timed run after a pass over the model's projections (which evicts the
    head from the cache, as a decode step does)."""
    generator = torch.Generator().manual_seed(1)
    one = {n: torch.randn(1, n, generator=generator).to(dtype) for n in {q.in_features for q in linears}}
    evict = lambda: [int4_linear(one[q.in_features], q.packed, q.scales_zeros) for q in linears]  # noqa: E731
    timings: dict[int, tuple[float, float]] = {}
    with torch.inference_mode():
        for rows in row_counts:
            x = torch.randn(rows, head.in_features, generator=generator).to(dtype)
            timings[rows] = (_best(lambda: head(x), repeats, evict),
                             _best(lambda: F.linear(x, dense_weight), repeats, evict))
    chosen = crossover(timings)
    log.info("CPU kernels: %s (rows: 8-bit/dense ms: %s)",
             f"a dense head from {chosen} rows, 8-bit below" if chosen else "the 8-bit head at every size",
             _shown(timings))
    return chosen


# decode rows .. a batch: where the 8-bit-activation kernel may win (on an AVX2-only CPU, whose
# torch kernels widen every weight to float, it still wins at 64); timed up to the first loss
Q8_ROW_COUNTS = (1, 2, 3, 4, 8, 16, 32, 64)


EVERY_SIZE = 1 << 30   # a `q8_below_rows` that no product reaches


def below(timings: dict[int, tuple[float, float]], every_from: int | None = None) -> int:
    """From {rows: (torch's packed ms, 8-bit-activation ms)}: 1 + the largest row count up to
    which the 8-bit-activation kernel wins (by WIN) at every count timed; 0 if not at 1 row;
    EVERY_SIZE where it wins at every count up to `every_from` rows or more (past a few dozen
    rows both kernels are bound by arithmetic, their times growing with the rows alike, so a
    prefill chunk of 256 keeps the ratio timed at 64: not timed, as it would add seconds to
    every start)."""
    below_rows = 0
    for rows in sorted(timings):
        packed_ms, q8_ms = timings[rows]
        if q8_ms > WIN * packed_ms:
            return below_rows
        below_rows = rows + 1
    if every_from is not None and timings and max(timings) >= every_from:
        return EVERY_SIZE
    return below_rows


def calibrate_q8(linears: list, head, int4_linear: Callable, q8_linear: Callable, dtype: torch.dtype, repeats: int = 4,
                 row_counts: tuple[int, ...] = Q8_ROW_COUNTS) -> tuple[int, int]:
    """(projections, head): the row counts below which the 8-bit-activation kernels
    (`q8_linear` for the head, q8_kernels.py) should run instead of torch's packed ones, each timed as the others (every
    projection once per run; the head after such a pass). 0 where they do not win at 1 row."""
    generator = torch.Generator().manual_seed(2)
    projections: dict[int, tuple[float, float]] = {}
    heads: dict[int, tuple[float, float]] = {}
    one = {n: torch.randn(1, n, generator=generator).to(dtype) for n in {q.in_features for q in linears}}
    evict = lambda: [int4_linear(one[q.in_features], q.packed, q.scales_zeros) for q in linears]  # noqa: E731
    lost = lambda timings: any(q8_ms > WIN * packed_ms for packed_ms, q8_ms in timings.values())  # noqa: E731
    with torch.inference_mode():
        for rows in row_counts:
            heads_timed = head is not None and head.q8_packed is not None and not lost(heads)
            if lost(projections) and not heads_timed:
                break   # `below` reads no count past a loss
            xs = {n: torch.randn(rows, n, generator=generator).to(dtype) for n in {q.in_features for q in linears}}
            packed = lambda: [int4_linear(xs[q.in_features], q.packed, q.scales_zeros) for q in linears]  # noqa: E731
            q8 = lambda: [int4_linear(xs[q.in_features], q.packed, q.scales_zeros, q8=q.q8,  # noqa: E731
                                      q8_below_rows=rows + 1) for q in linears]
            if not lost(projections):
                projections[rows] = tuple(_best_of([packed, q8], repeats))
            if heads_timed:
                x = torch.randn(rows, head.in_features, generator=generator).to(dtype)
                split = lambda: int4_linear(torch.cat([x, x], -1), head.packed, head.scales_zeros)  # noqa: E731
                q8_head = lambda: q8_linear(x, head.q8_packed, head.q8_scales)  # noqa: E731
                heads[rows] = tuple(_best_of([split, q8_head], repeats, evict))
    chosen = below(projections, row_counts[-1]), below(heads, row_counts[-1]) if heads else 0
    log.info("CPU kernels: 8-bit activations (llama.cpp's arithmetic) %s for the projections, %s for the head "
             "(rows: torch 4-bit/8-bit-activation ms: projections %s; head %s)",
             rows_shown(chosen[0]), rows_shown(chosen[1]), _shown(projections), _shown(heads) or "-")
    return chosen


def rows_shown(below_rows: int) -> str:
    """"below N rows", "at every size" or "off", for logs."""
    return "at every size" if below_rows >= EVERY_SIZE else f"below {below_rows} rows" if below_rows else "off"


def _shown(timings: dict[int, tuple[float, float]]) -> str:
    return ", ".join(f"{rows}: {a:.2f}/{b:.2f}" for rows, (a, b) in timings.items())


def _cpuinfo(cpuinfo: str) -> tuple[str, set[str]]:
    """The first model name and flags line of /proc/cpuinfo ("unknown CPU", {} where unread)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return "unknown CPU", set()
    name, flags = "unknown CPU", set()
    for line in text.splitlines():
        if line.startswith("model name") and name == "unknown CPU":
            name = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    return name, flags


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (empty where they cannot be read)."""
    return _cpuinfo(cpuinfo)[1]


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name and the flags that choose its kernels, for logs and bench rows."""
    name, flags = _cpuinfo(cpuinfo)
    kinds = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags]
    return f"{name} [{' '.join(kinds) or 'no AVX2'}]"
