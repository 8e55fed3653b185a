"""Where one engine decode step's time goes, per batch size: the whole `step()`, the runner's
`execute` (inputs, forward pass, sampling, the token copy back), the engine's per-token update
(the rest: detokenize, finish rules, outputs), and on CUDA the GPU time of a replayed decode graph
alone (CUDA events around back-to-back replays) and the graphs' capture time at start-up.

Step time minus GPU time is what the host adds to every step; on a GPU with a small model that
is the part left to overlap or cut. Requests are decode-only (prompts prefilled before timing),
greedy (or `--sampling chat`: temperature 0.7, top-p 0.9), EOS masked, so every row decodes every
timed step.

Each tree runs in its own subprocess (its own `worker` package); `--baseline-root` measures
another checkout in the same run, and the table gives this tree's tokens/s over the baseline's:

    python bench/engine_step.py --device cuda --random-weights smollm2-135m --tokenizer DIR \\
        --baseline-root /tmp/base          # git worktree add /tmp/base <commit>
    .venv/bin/python bench/engine_step.py --rows 1,16 --steps 20   # CPU, SmolLM2 shape
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import table, write_json  # noqa: E402


SAMPLING = {"greedy": dict(temperature=0.0), "chat": dict(temperature=0.7, top_p=0.9)}


def child(root: Path, args) -> list[dict]:
    """Runs in a subprocess with `root`'s packages first on sys.path."""
    sys.path.insert(0, str(root))
    import time

    import torch

    from bench.engine import random_model
    try:
        from shared.sampling import SamplingParams
    except ImportError:   # a --baseline-root from before issue 33
        from shared.streams import SamplingParams
    from worker.engine import Engine, EngineConfig, EngineRequest
    from worker.engine.config import resolve_dtype

    device = args.device
    if args.random_weights:
        model, tok = random_model(args.random_weights, device, resolve_dtype("auto", device), args.tokenizer)
    else:   # the real SmolLM2-135M-Instruct from its GGUF: trained logits, as sampling meets them
        from shared.config import Settings
        from worker.engine import load_model
        model, tok = load_model(Settings(model_path="", device=device, dtype="auto"))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        modes = (True, False) if device == "cuda" else (False,)
        for graphs in modes:
            config = dict(max_batch=rows, max_seq_len=args.prompt + args.steps + 64, prefill_chunk=4096,
                          device=device, dtype=model.dtype)
            try:
                engine = Engine(model, tok, EngineConfig(**config, cuda_graphs=graphs))
            except TypeError:   # a baseline without the setting: it has no graphs
                if graphs:
                    continue
                engine = Engine(model, tok, EngineConfig(**config))
            captured = getattr(engine.runner, "graphs", None)
            for i in range(rows):
                engine.add(EngineRequest(str(i), [1 + (i * 7 + j) % 40000 for j in range(args.prompt)],
                                         SamplingParams(max_tokens=args.steps + 32, **SAMPLING[args.sampling]), ignore_eos=True))
            while engine.num_waiting or any(s.pending > 1 or s.computed == 0 for s in engine.scheduler.running):
                engine.step()   # prefill
            for _ in range(3):
                engine.step()
            sync()
            execute_s: list[float] = []
            execute = engine.runner.execute

            def timed(plan, execute=execute, execute_s=execute_s):
                t = time.perf_counter()
                out = execute(plan)
                execute_s.append(time.perf_counter() - t)
                return out
            engine.runner.execute = timed
            step_s = []
            for _ in range(args.steps):
                t = time.perf_counter()
                engine.step()
                step_s.append(time.perf_counter() - t)
            gpu_ms = None
            if captured is not None:
                size = captured.size_for(rows)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(50):
                    captured.replay(size)
                end.record()
                sync()
                gpu_ms = start.elapsed_time(end) / 50
            step_ms, execute_ms = 1000 * statistics.median(step_s), 1000 * statistics.median(execute_s)
            results.append({"rows": rows, "graphs": graphs, "step_ms": step_ms, "execute_ms": execute_ms,
                            "update_ms": step_ms - execute_ms, "tok_s": rows / step_ms * 1000,
                            "graph_gpu_ms": gpu_ms, "host_ms": None if gpu_ms is None else step_ms - gpu_ms,
                            "capture_s": getattr(captured, "capture_seconds", None)})
            del engine
            if device == "cuda":
                torch.cuda.empty_cache()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--random-weights", default="smollm2-135m", help='a shape from bench/engine.py, or "" for '
                    "the real SmolLM2 GGUF (random weights' flat distributions send every top-p row to the "
                    "sampler's full sort)")
    ap.add_argument("--tokenizer", default="", help="a saved tokenizer directory instead of SmolLM2's GGUF")
    ap.add_argument("--rows", default="1,64,256")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--sampling", default="greedy", choices=sorted(SAMPLING))
    ap.add_argument("--baseline-root", type=Path, default=None, help="another checkout, measured alongside")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    trees = {"this": ROOT} | ({"baseline": args.baseline_root.resolve()} if args.baseline_root else {})
    runs = {}
    for name, root in trees.items():
        argv = [sys.executable, __file__, "--child", str(root), "--device", args.device, "--random-weights",
                args.random_weights, "--tokenizer", args.tokenizer, "--rows", args.rows, "--prompt", str(args.prompt),
                "--steps", str(args.steps), "--sampling", args.sampling]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        runs[name] = json.loads(out.strip().splitlines()[-1])
        for row in runs[name]:
            row["tree"] = name
    baseline = {r["rows"]: r for r in runs.get("baseline", []) if not r["graphs"]}
    rows = []
    for row in runs["this"] + runs.get("baseline", []):
        base = baseline.get(row["rows"])
        rows.append({**row, "x_baseline_tok_s": row["tok_s"] / base["tok_s"] if base and row["tree"] == "this" else None})
    print(table(rows, ["tree", "rows", "graphs", "step_ms", "execute_ms", "update_ms", "graph_gpu_ms", "host_ms",
                       "tok_s", "x_baseline_tok_s", "capture_s"]))
    path = write_json("engine_step", {"device": args.device, "model": f"random {args.random_weights}",
                                      "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
