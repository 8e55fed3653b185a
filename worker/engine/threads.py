"""How many threads torch's intra-op pool gets in a CPU worker (TORCH_THREADS=0, the default).

torch's default is one thread per core. That is right for a process alone on a machine and
wrong for a worker, which never is: its own Redis loop runs beside the engine, and the embedded
default (`scripts/serve.sh`) puts the gateway and Redis on the same cores. An OpenMP team that
spans every core loses a core to any of them at each of the ~200 parallel regions of a step,
and the whole team waits at the region's barrier (docs/operations.md, "Threads and cores";
bench/RESULTS.md, "Serving": two torch threads beside the stack on a 2-core box gave one user
half the engine's speed).

So a decode step of few rows takes every usable core but one (at least one): the one left runs
the worker's Redis loop, the gateway and Redis when they share the box, and absorbs the OS. One
user's decode step is short and the stack's own work per token (Redis commit, the gateway's
read and write, the client) falls between and inside it, so a team spanning every core loses
more than the extra core gives (2-core EPYC, one stream through the stack: ITL 19.3 ms with one
thread, 24.8-31.8 ms with two). A step of many tokens (a batch of decode rows, a prefill chunk)
is arithmetic: it takes every usable core (`StepThreads`), which there gains more than the
stack's work between steps costs (16 streams through the stack: 103 -> 138 tok/s; the engine
alone 102 -> 179). docs/operations.md, "Threads and cores", has the measurements. The 4-bit /
dense crossover (cpu_kernels.py) is timed at start with the narrow count: on the 2-core EPYC it
is 32 rows with one thread and 64 with two, so a wide step of 32-63 rows runs dense where the
4-bit kernel would still be faster (bench/RESULTS.md, "Engine").

A step of decode rows that runs every layer in one C++ call (decode_layers.cpp, CPU) takes every
usable core at any size: with no Python between its ~120 parallel regions the team stays hot
and the second core is a gain, through the stack too (2-core Xeon, one stream through the
OpenAI API, the same runs: ITL 15.8 ms with one thread, 13.4 with two; llama.cpp 16.9-17.4;
bench/RESULTS.md). Its kernels were still chosen by timings at the narrow count.

OpenMP's idle threads spin before they sleep: libgomp's default (300,000 spins, milliseconds)
keeps the team's second core busy between steps, where the gateway and Redis need it. The
worker sets `GOMP_SPINCOUNT=10000` (~0.2 ms: still hot between the regions of one step) unless
the environment sets it (`SPIN_ENV`): a two-thread stack went from ITL 31.8 to 24.8 ms with it,
and a two-thread engine alone lost nothing (12.0 vs 12.1 ms a step at one row).

Usable cores are the process's CPU affinity capped by its cgroup's CPU quota (a container
limited with `--cpus 2` on a 64-core host sees 64 cores in os.cpu_count()). CUDA workers keep
torch's default: their host work is one thread of kernel launches.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

log = logging.getLogger(__name__)


def usable_cores(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """Cores this process may run on: its affinity, capped by a cgroup v2 `cpu.max` quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        quota, period = Path(cgroup_root, "cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


SPIN_ENV = {"GOMP_SPINCOUNT": "10000"}   # read by libgomp when it loads: set before a process imports torch


def bound_openmp_spin() -> None:
    """`SPIN_ENV` into this process's environment where it does not set them: for the torch a
    process imports after this, or a process it spawns (the worker's engine)."""
    for key, value in SPIN_ENV.items():
        os.environ.setdefault(key, value)


def default_torch_threads(cores: int) -> int:
    """A CPU engine's intra-op threads on `cores` usable cores: all but one, at least one."""
    return max(1, cores - 1)


def apply_torch_threads(settings, device: str = "cpu") -> int:
    """Set torch's intra-op threads for this process from TORCH_THREADS (0: the policy above on
    CPU, torch's default on CUDA) and return the count."""
    import torch
    if settings.torch_threads > 0:
        threads = settings.torch_threads
    elif device == "cpu":
        threads = default_torch_threads(usable_cores())
    else:
        return torch.get_num_threads()
    torch.set_num_threads(threads)
    return threads


def wide_torch_threads(settings, device: str = "cpu") -> int:
    """The threads a step of many tokens takes (every usable core), or 0 when steps never change
    the count: a fixed TORCH_THREADS, CUDA, TORCH_WIDE_FROM_TOKENS=0, or one core."""
    if device != "cpu" or settings.torch_threads > 0 or settings.torch_wide_from_tokens <= 0:
        return 0
    cores = usable_cores()
    return cores if cores > default_torch_threads(cores) else 0


class StepThreads:
    """Per step, torch's intra-op threads by the step's size: `narrow` below `from_tokens`
    tokens, `wide` from there (see the module's docstring). Changing the count costs ~2 µs
    (libgomp keeps its pool), and it changes only when the size crosses the line."""

    __slots__ = ("narrow", "wide", "from_tokens", "current", "_set")

    def __init__(self, narrow: int, wide: int, from_tokens: int, set_threads=None):
        import torch
        self.narrow, self.wide, self.from_tokens = narrow, wide, from_tokens
        self._set = set_threads or torch.set_num_threads
        self.current = narrow

    @property
    def active(self) -> bool:
        return self.wide > self.narrow and self.from_tokens > 0

    def fit(self, tokens: int, one_call: bool = False) -> int:
        """Set the count for a step of `tokens` tokens (`one_call`: decode rows only, every
        layer in one C++ call: wide at any size, see the module's docstring); returns it."""
        want = self.wide if self.active and (one_call or tokens >= self.from_tokens) else self.narrow
        if want != self.current:
            self._set(want)
            self.current = want
        return want
