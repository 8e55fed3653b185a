"""How many threads torch's intra-op pool gets in a CPU worker (TORCH_THREADS=0, the default).

torch's default is one thread per core. That is right for a process alone on a machine and
wrong for a worker, which never is: its own Redis loop runs beside the engine, and the embedded
default (`scripts/serve.sh`) puts the gateway and Redis on the same cores. An OpenMP team that
spans every core loses a core to any of them at each of the ~200 parallel regions of a step,
and the whole team waits at the region's barrier (docs/operations.md, "Threads and cores";
bench/RESULTS.md, "Serving": two torch threads beside the stack on a 2-core box gave one user
half the engine's speed).

So the engine takes every usable core but one (at least one): the one left runs the worker's
Redis loop, the gateway and Redis when they share the box, and absorbs the OS. A single stream's
decode step is bound by weight bytes, not by arithmetic, and loses nothing with one thread fewer
(measured on a 2-core EPYC: 1 thread 20.2 ms, 2 threads 19.2 ms a token alone, and 2 threads
lose beside the stack); batched decode and prefill are arithmetic and gain from every core a
dedicated worker box gives them (docs/operations.md, "Threads and cores").

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
