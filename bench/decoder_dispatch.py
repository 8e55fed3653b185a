"""Host dispatch cost of one engine decode step: tensor operations per step and per layer, and
the step time where dispatch is all there is.

On a GPU, each tensor operation of the forward pass is a kernel launch paid on the host (several
µs of Python and dispatcher each); for a 135M-parameter model the device work of a decode step is
far smaller than that, so eager decode is bound by how many operations a step runs, at every
batch size (until the step is replayed as a CUDA graph). This counts them exactly (a
TorchDispatchMode sees every ATen call, views included: each costs host time even where it
launches nothing) and times decode steps of a model that has the real depth but a tiny width
(`--layers`, hidden 64), where the arithmetic is negligible and the step time is the dispatch
cost, the same code a GPU step runs. A second model, SmolLM2-135M's real shape with random
weights, shows the effect where the CPU's arithmetic is real.

Each tree runs in its own subprocess (its own `worker` package), alternating, `--repeat` times;
ratios are this tree over the baseline of the same run:

    .venv/bin/python bench/decoder_dispatch.py --baseline-root /tmp/base   # git worktree add /tmp/base <commit>
    .venv/bin/python bench/decoder_dispatch.py --rows 1,16,64 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(root: Path, shape: str, rows: int, layers: int, steps: int, threads: int, dtype: str) -> dict:
    """Runs in a subprocess with `root`'s worker package first on sys.path."""
    sys.path.insert(0, str(root))
    import collections
    import time

    import torch
    import transformers
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig, LlamaForCausalLM

    from shared.sampling import SamplingParams
    from worker.engine import Engine, EngineConfig, EngineRequest

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if shape == "tiny":   # real depth, negligible arithmetic: the step is its dispatch cost
        config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2)
    else:                 # SmolLM2-135M's shape
        config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                             num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                             max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    for module in model.modules():   # trained norms are not all ones; in bf16 that decides which norm form is exact
        if type(module).__name__.endswith("RMSNorm"):
            module.weight.data.normal_(1.0, 0.2)
    model = model.to(getattr(torch, dtype))

    class Tok:   # the detokenizer's needs only; text is not what this measures
        eos_token_id = 0

        def decode(self, ids, **_):
            return "x" * len(ids)

    engine = Engine(model, Tok(), EngineConfig(max_batch=rows, max_seq_len=64 + steps + 64, prefill_chunk=64 * rows,
                                               dtype=model.dtype))
    for i in range(rows):
        engine.add(EngineRequest(rid=f"r{i}", prompt_ids=[100 + (i + j) % 300 for j in range(64)],
                                 params=SamplingParams(max_tokens=steps + 32, temperature=0.0), ignore_eos=True))
    for _ in range(5):   # prefill, warm-up
        engine.step()

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    with Count() as counted:
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return {"ops_per_step": sum(counted.ops.values()), "step_ms": 1000 * statistics.median(times),
            "layers": config.num_hidden_layers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-root", type=Path, default=None, help="another checkout, measured alongside")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--layers", type=int, default=30, help="depth of the tiny-width model")
    ap.add_argument("--shapes", default="tiny,smollm2-135m")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the models' dtype (bf16: CUDA's default, and a 4-bit CPU worker's activations)")
    ap.add_argument("--child", nargs=3, metavar=("ROOT", "SHAPE", "ROWS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        root, shape, rows = args.child
        print(json.dumps(child(Path(root), shape, int(rows), args.layers, args.steps, args.threads, args.dtype)))
        return

    sys.path.insert(0, str(ROOT))
    from bench.common import table, write_json

    trees = [("this", ROOT)] + ([("baseline", args.baseline_root.resolve())] if args.baseline_root else [])
    samples: dict[tuple, list[dict]] = {}
    for _ in range(args.repeat):
        for shape in args.shapes.split(","):
            for rows in (int(r) for r in args.rows.split(",")):
                for name, root in reversed(trees):   # baseline first in each round
                    out = subprocess.run([sys.executable, __file__, "--child", str(root), shape, str(rows),
                                          "--layers", str(args.layers), "--steps", str(args.steps),
                                          "--threads", str(args.threads), "--dtype", args.dtype],
                                         check=True, capture_output=True, text=True)
                    samples.setdefault((shape, rows, name), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    results = []
    for (shape, rows, name), runs in samples.items():
        row = {"shape": shape, "rows": rows, "tree": name, "ops_per_step": runs[0]["ops_per_step"],
               "ops_per_layer": None, "step_ms": statistics.median(r["step_ms"] for r in runs),
               "step_ms_runs": [round(r["step_ms"], 3) for r in runs]}
        results.append(row)
    for row in results:   # per-layer ops: the step's ops over the layers (the fixed part included)
        row["ops_per_layer"] = round(row["ops_per_step"] / (args.layers if row["shape"] == "tiny" else 30), 1)
        base = samples.get((row["shape"], row["rows"], "baseline"))
        if base and row["tree"] == "this":
            row["x_baseline_step_ms"] = round(row["step_ms"] / statistics.median(r["step_ms"] for r in base), 3)
            row["x_baseline_ops"] = round(row["ops_per_step"] / base[0]["ops_per_step"], 3)
    results.sort(key=lambda r: (r["shape"], r["rows"], r["tree"] != "baseline"))
    print(table(results, ["shape", "rows", "tree", "ops_per_step", "ops_per_layer", "step_ms", "step_ms_runs",
                          "x_baseline_ops", "x_baseline_step_ms"]))
    print("wrote", write_json("decoder_dispatch", {"args": {k: str(v) for k, v in vars(args).items()},
                                                   "results": results}))


if __name__ == "__main__":
    main()
