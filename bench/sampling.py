"""Time of one sampling call per step, by batch size and sampling parameters, against another
checkout's sampler in the same run.

Sampling runs once per engine step on the logits of every row that produces a token; its cost
is per row per step and does not shrink with a faster forward pass. Most chat traffic samples
(temperature > 0, often top-p), while the throughput benchmarks decode greedily, so this measures
it on its own, on SmolLM2's real logits (`--logits smollm2`, the default: the model's next-token
logits along sampled answers to a few chat prompts, so top-p meets the distributions a chat
model really has) or on random ones (`--logits synthetic`: a normal tail plus 8 dominant tokens
per row, flatter than a trained model's), timing this tree's `sample` and the baseline's on the
same rows, median of `--repeat`.

    .venv/bin/python bench/sampling.py --baseline-root /tmp/base      # git worktree add /tmp/base <commit>
    .venv/bin/python bench/sampling.py --save-logits .devcarry/logits.pt     # here, then on the GPU box:
    python bench/sampling.py --device cuda --logits .devcarry/logits.pt --baseline-root /tmp/base
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

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import table, write_json  # noqa: E402
from worker.engine import sampling  # noqa: E402

MIXES = {  # name: (temperature, top_k, top_p, seeded)
    "greedy": (0.0, 0, 1.0, False),
    "default (t=1)": (1.0, 0, 1.0, False),
    "chat (t=0.7, top_p=0.9)": (0.7, 0, 0.9, False),
    "top_k=40 (t=0.8)": (0.8, 40, 1.0, False),
    "creative (t=1, top_p=0.95)": (1.0, 0, 0.95, False),
    "seeded chat": (0.7, 0, 0.9, True),
}


def load_sampler(root: Path):
    spec = importlib.util.spec_from_file_location("baseline_sampling", root / "worker/engine/sampling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def smollm2_logits(rows: int) -> torch.Tensor:
    """`rows` next-token logit rows of SmolLM2-135M-Instruct (CPU, fp32) along answers sampled
    at temperature 1 to a few chat prompts (distinct positions, several contexts)."""
    from shared.config import Settings
    from worker.engine import build_prompt_ids, load_model

    model, tok = load_model(Settings(model_path="", device="cpu", dtype="float32"))
    prompts = ["Write a short story about a dragon who loves tea.", "Why is the sky blue?",
               "Give me ideas for a birthday party.", "Explain recursion to a child.",
               "Write a poem about autumn leaves.", "What should I pack for a week in Japan?"]
    torch.manual_seed(0)
    per_prompt = -(-rows // len(prompts))
    found = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = build_prompt_ids(tok, None, [{"role": "user", "content": prompt}])
            out = model.generate(torch.tensor([ids]), max_new_tokens=per_prompt, min_new_tokens=per_prompt,
                                 do_sample=True, temperature=1.0, top_p=0.95, pad_token_id=tok.eos_token_id)
            found.append(model(out).logits[0, len(ids) - 1 : -1])
    return torch.cat(found)[:rows].contiguous()


def sampler_call(module, rows: int, mix: tuple, device: str):
    """One step's sampling as the engine does it with `module`: with a per-slot table (written
    once, outside the timing; each call gathers the step's rows by slot, as the runner does), or
    with per-row lists for samplers from before the table."""
    temperature, top_k, top_p, seeded = mix
    shared = module.make_generator(0, device)
    gens = [module.make_generator(i, device) if seeded else None for i in range(rows)]
    if not hasattr(module, "SamplingTable"):
        args = ([temperature] * rows, [top_k] * rows, [top_p] * rows, gens, shared)
        return lambda logits: module.sample(logits, *args)
    table = module.SamplingTable.of([temperature] * rows, [top_k] * rows, [top_p] * rows, gens, device)
    slots = np.arange(rows)
    slots_dev = torch.from_numpy(slots).to(device)
    return lambda logits: module.sample(logits, table.rows(slots, slots_dev), shared)


def time_call(module, logits: torch.Tensor, mix: tuple, repeat: int, device: str) -> float:
    call = sampler_call(module, logits.shape[0], mix, device)
    call(logits)
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        call(logits).tolist()   # the engine reads the tokens back every step
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--logits", default="smollm2",
                    help="smollm2, synthetic, or a file written by --save-logits (a GPU machine without the GGUF)")
    ap.add_argument("--save-logits", type=Path, default=None,
                    help="write the SmolLM2 rows used (bf16, ~25 MB for 256 rows) to this file and exit")
    ap.add_argument("--baseline-root", type=Path, default=None, help="another checkout; its sampler is timed alongside")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    trees = [("this", sampling)]
    if args.baseline_root:
        trees.insert(0, ("baseline", load_sampler(args.baseline_root.resolve())))
    results = []
    row_counts = [int(r) for r in args.rows.split(",")]
    if args.save_logits:
        torch.save(smollm2_logits(max(row_counts)).bfloat16(), args.save_logits)
        print("wrote", args.save_logits)
        return
    if args.logits == "smollm2":
        pool = smollm2_logits(max(row_counts))
    elif args.logits == "synthetic":
        pool = None
    else:
        pool = torch.load(args.logits).float()
        assert pool.shape[0] >= max(row_counts), f"{args.logits} holds {pool.shape[0]} rows"
    for rows in row_counts:
        if pool is not None:
            logits = pool[:rows].to(args.device)
        else:
            g = torch.Generator().manual_seed(rows)
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
