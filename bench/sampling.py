"""Time of one sampling call per step, by batch size and sampling parameters, against another
checkout's sampler in the same run.

Sampling runs once per engine step on the logits of every row that produces a token; its cost
is per row per step and does not shrink with a faster forward pass. Most chat traffic samples
(temperature > 0, often top-p), while the throughput benchmarks decode greedily, so this measures
it on its own: SmolLM2's vocabulary (49,152), random logits shaped like a model's (a few
dominant tokens), alternating this tree's `sample` with the baseline's, median of `--repeat`.

    .venv/bin/python bench/sampling.py --baseline-root /tmp/base      # git worktree add /tmp/base <commit>
    .venv/bin/python bench/sampling.py --rows 1,16 --device cuda
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import table, write_json  # noqa: E402
from worker.engine import sampling  # noqa: E402

MIXES = {  # name: (temperature, top_k, top_p, seeded)
    "greedy": (0.0, 0, 1.0, False),
    "default (t=1)": (1.0, 0, 1.0, False),
    "chat (t=0.7, top_p=0.9)": (0.7, 0, 0.9, False),
    "top_k=40 (t=0.8)": (0.8, 40, 1.0, False),
    "seeded chat": (0.7, 0, 0.9, True),
}


def load_sampler(root: Path):
    spec = importlib.util.spec_from_file_location("baseline_sampling", root / "worker/engine/sampling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_call(module, logits: torch.Tensor, mix: tuple, repeat: int, device: str) -> float:
    temperature, top_k, top_p, seeded = mix
    rows = logits.shape[0]
    shared = module.make_generator(0, device)
    gens = [module.make_generator(i, device) if seeded else None for i in range(rows)]
    args = ([temperature] * rows, [top_k] * rows, [top_p] * rows, gens, shared)
    module.sample(logits, *args)
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        module.sample(logits, *args).tolist()   # the engine reads the tokens back every step
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--baseline-root", type=Path, default=None, help="another checkout; its sampler is timed alongside")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    trees = [("this", sampling)]
    if args.baseline_root:
        trees.insert(0, ("baseline", load_sampler(args.baseline_root.resolve())))
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        g = torch.Generator().manual_seed(rows)
        # a model-like shape: a long tail plus a handful of strong candidates per row
        logits = torch.randn(rows, args.vocab, generator=g) * 2
        logits.scatter_add_(1, torch.randint(0, args.vocab, (rows, 8), generator=g), torch.full((rows, 8), 9.0))
        logits = logits.to(args.device)
        for name, mix in MIXES.items():
            row = {"rows": rows, "params": name}
            for code, module in trees:
                row[f"{code}_ms"] = round(time_call(module, logits, mix, args.repeat, args.device), 3)
            if args.baseline_root:
                row["x_baseline"] = round(row["this_ms"] / row["baseline_ms"], 3)
            results.append(row)
            print(row, flush=True)
    cols = ["rows", "params"] + [f"{c}_ms" for c, _ in trees] + (["x_baseline"] if args.baseline_root else [])
    print(table(results, cols))
    print("wrote", write_json("sampling", {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}))


if __name__ == "__main__":
    main()
