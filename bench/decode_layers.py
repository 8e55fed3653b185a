"""A CPU decode step through every layer in one call (worker/engine/decode_layers.cpp) against the
decoder's layer loop, at one and at every usable thread, in one process and one run.

The real SmolLM2-135M-Instruct GGUF (the worker's default model and kernels, as calibrated at
start), `--rows` decode rows at a `--context`-token context; each variant steps the same engine
in turn, in blocks of `--steps` steps, `--blocks` times (this VM kind's speed drifts by 2x over
minutes: only the ratios within a run are read). Per variant: the median and best block's ms a
step, and its speed over the loop's at one thread.

    .venv/bin/python bench/decode_layers.py --rows 1,4 --blocks 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import table, write_json  # noqa: E402


def measure(rows: int, args) -> list[dict]:
    import torch

    from shared.config import Settings
    from shared.sampling import SamplingParams
    from worker.engine import Engine, EngineConfig, EngineRequest, load_model
    from worker.engine.threads import usable_cores

    torch.set_num_threads(1)
    model, tok = load_model(Settings(model_path="", device="cpu", dtype="auto"))
    decode = args.blocks * 4 * (args.steps + 2) + 8   # every step of every variant and block
    engine = Engine(model, tok, EngineConfig(max_batch=rows, max_seq_len=args.context + decode, prefill_chunk=4096,
                                             device="cpu", dtype=model.dtype))
    for i in range(rows):
        engine.add(EngineRequest(str(i), [1 + (i * 7 + j) % 40000 for j in range(args.context)],
                                 SamplingParams(max_tokens=decode, temperature=0.0), ignore_eos=True))
    while engine.num_waiting or any(s.pending > 1 or s.computed == 0 for s in engine.scheduler.running):
        engine.step()
    decoder = engine.runner.decoder
    stack = decoder.decode_layers
    if stack is None:
        raise SystemExit("no one-call path here (row kernels off, or no C++ compiler)")
    threads = sorted({1, usable_cores()})
    variants = [(name, n) for n in threads for name in ("one call", "layer loop")]
    times: dict[tuple[str, int], list[float]] = {v: [] for v in variants}
    for _ in range(args.blocks):
        for name, n in variants:
            torch.set_num_threads(n)
            decoder.decode_layers = stack if name == "one call" else None
            for _ in range(2):
                engine.step()
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times[(name, n)].append((time.perf_counter() - start) / args.steps * 1e3)
    decoder.decode_layers = stack
    base = statistics.median(times[("layer loop", 1)])
    return [{"rows": rows, "path": name, "threads": n, "ms_step_p50": statistics.median(v), "ms_step_min": min(v),
             "x_loop_1_thread": base / statistics.median(v)} for (name, n), v in times.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--name", default="decode_layers")
    args = ap.parse_args()
    from worker.engine.cpu_kernels import cpu_model
    results = [r for rows in args.rows.split(",") for r in measure(int(rows), args)]
    print(table(results, ["rows", "path", "threads", "ms_step_p50", "ms_step_min", "x_loop_1_thread"]))
    print(f"CPU: {cpu_model()}")
    print(f"wrote {write_json(args.name, {'args': vars(args), 'results': results})}")


if __name__ == "__main__":
    main()
