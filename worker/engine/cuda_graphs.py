"""CUDA graphs for decode-only steps: a whole forward pass replayed as one launch.

For a small model, an eager GPU decode step is bound by the host: every tensor operation (about
1000-1400 a step for a 30-layer model) costs several µs of Python, dispatch and kernel launch,
while the GPU's own work for a few hundred rows is a fraction of that. A captured graph replays
the same kernels without the host (vLLM and TGI do the same; vLLM v1's `CUDAGraphRunner`).

What makes a step capturable: every input lives at a fixed address (the runner's device staging
buffers: ids, positions, pool rows, lengths, block tables), decode attention is the paged kernel
(`paged_attention.py`, fixed shapes, no per-step masks or segment lists), and nothing in the step
syncs with the host. Graphs are captured once, at start-up, for a ladder of batch sizes
(`capture_sizes`); a step of n rows replays the smallest size >= n, its extra rows padded to
write and read the KV cache's scratch block. Steps with prompt chunks run eagerly. The graph
ends at the final norm: lm_head runs eagerly on the real rows only.

The graphs share one memory pool, captured largest first so the smaller ones reuse its blocks.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from worker.engine.attention import StepMeta


def capture_sizes(max_rows: int) -> list[int]:
    """Batch sizes to capture, ascending: 1, 2, 4, then every 8 to 64, every 16 to 256, every
    32 beyond (padding wastes at most ~12% of a step's rows above 8), and `max_rows` itself."""
    ladder = [1, 2, 4] + list(range(8, 64, 8)) + list(range(64, 256, 16)) + list(range(256, max_rows, 32))
    return sorted({s for s in ladder if s < max_rows} | {max_rows})


class DecodeGraphs:
    def __init__(self, decoder, ids: torch.Tensor, positions: torch.Tensor,
                 make_meta: Callable[[int], StepMeta], sizes: list[int]):
        """`ids` / `positions`: the device staging rows the graphs read; `make_meta(n)`: a step
        meta of n decode rows over the staging buffers (filled with valid padding before
        capture)."""
        self.sizes = sorted(sizes)
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        started = time.perf_counter()

        def forward(n: int) -> torch.Tensor:
            return decoder.norm(decoder.hidden(ids[:n], positions[:n], make_meta(n)))

        with torch.inference_mode():
            # warm-up outside capture, on a side stream (as torch.cuda.graphs advises): Triton's
            # compile and cuBLAS's per-shape set-up must not happen while capturing
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for n in reversed(self.sizes):
                    forward(n)
            torch.cuda.current_stream().wait_stream(side)
            for n in reversed(self.sizes):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self._outputs[n] = forward(n)
                self._graphs[n] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - started   # start-up cost, reported by benchmarks

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    def size_for(self, rows: int) -> int | None:
        """The captured size a step of `rows` decode rows replays (None: more than captured)."""
        for n in self.sizes:
            if n >= rows:
                return n
        return None

    def replay(self, size: int) -> torch.Tensor:
        """Run the captured step of `size` rows; returns its final-normed hidden states
        [size, hidden] (a static tensor, overwritten by the next replay)."""
        self._graphs[size].replay()
        return self._outputs[size]
