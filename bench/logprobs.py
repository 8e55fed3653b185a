"""What logprobs cost a decode step: the engine's step time at `--rows` decoding rows with 0
(the baseline: nothing computed), 8 and all of them asking for logprobs (`--top` alternatives
each), in the same run.

The cost must fall only on the rows that ask: 0 asking pays one integer test per step; k asking
pay a log-softmax over their k rows, a gather and a top-k on the device, the transfer of those
numbers with the sampled tokens, and on the host each token's entry (its text and its
alternatives', memoised per id). Three engines share one model (random weights of a real shape,
or `tiny`: the same 49k vocabulary under a 2-layer 64-wide model, where the forward pass is
cheap, as on a GPU, and the logprob work shows most), all rows prefilled, EOS masked; their
steps are interleaved, so machine noise falls on every configuration alike. Median of `--steps`.

    .venv/bin/python bench/logprobs.py                           # CPU, SmolLM2-135M's shape and tiny
    python bench/logprobs.py --device cuda --shapes smollm2-135m,qwen2.5-0.5b --tokenizer DIR
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

import torch  # noqa: E402

from bench.common import table, write_json  # noqa: E402
from bench.engine import RANDOM_CONFIGS, random_model  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402
from worker.engine import Engine, EngineConfig, EngineRequest  # noqa: E402
from worker.engine.config import resolve_dtype  # noqa: E402

TINY = ("llama", dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True))


def engine_with(model, tok, args, asking: int) -> Engine:
    """`args.rows` requests decoding (prompts computed), the first `asking` of them with logprobs."""
    engine = Engine(model, tok, EngineConfig(max_batch=args.rows, max_seq_len=args.prompt + args.steps + 32,
                                             prefill_chunk=4096, device=args.device, dtype=model.dtype))
    for i in range(args.rows):
        params = SamplingParams(max_tokens=args.steps + 16, temperature=args.temperature,
                                logprobs=args.top if i < asking else None)
        engine.add(EngineRequest(str(i), [1 + (i * 7 + j) % 40000 for j in range(args.prompt)], params,
                                 ignore_eos=True))
    while engine.num_waiting or any(s.pending > 1 or s.computed == 0 for s in engine.scheduler.running):
        engine.step()
    for _ in range(2):
        engine.step()
    return engine


def measure(model, tok, args, shape: str) -> list[dict]:
    counts = [int(a) for a in args.asking.split(",")]
    engines = {a: engine_with(model, tok, args, a) for a in counts}
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times: dict[int, list[float]] = {a: [] for a in counts}
    for _ in range(args.steps):
        for a, engine in engines.items():     # interleaved: noise falls on every configuration
            sync()
            t = time.perf_counter()
            outs = engine.step()
            sync()
            times[a].append(time.perf_counter() - t)
            assert sum(o.logprobs is not None for o in outs) == a
    return ratio_rows(times, counts, shape=shape, rows=args.rows)


def ratio_rows(times: dict[int, list[float]], counts: list[int], **fields) -> list[dict]:
    """Per count of asking rows, its median step and its ratio to the first count's (the baseline)."""
    base = statistics.median(times[counts[0]])
    return [{**fields, "asking": a, "step_ms": round(1000 * statistics.median(times[a]), 3),
             "x_none_asking": round(statistics.median(times[a]) / base, 3)} for a in counts]


def shape_parser(doc: str) -> argparse.ArgumentParser:
    """The options every per-shape engine bench here takes."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shapes", default="tiny,smollm2-135m", help=f"tiny or of {sorted(RANDOM_CONFIGS)}")
    ap.add_argument("--tokenizer", default="", help="a saved tokenizer directory instead of SmolLM2's GGUF")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest on a shared machine)")
    return ap


def main() -> None:
    ap = shape_parser(__doc__)
    ap.add_argument("--asking", default="0,8,64", help="rows asking for logprobs, per configuration (first: baseline)")
    ap.add_argument("--top", type=int, default=5, help="top_logprobs of the rows that ask")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    run_shapes(args, lambda *a: [{**r, "top": args.top} for r in measure(*a)], "logprobs",
               ["shape", "rows", "asking", "top", "step_ms", "x_none_asking"])


def run_shapes(args, measure, name: str, columns: list[str]) -> None:
    """`measure(model, tokenizer, args, shape)` for each of `args.shapes` (one random-weight model
    each), printed as a table and written as bench/results/<name>.json."""
    torch.set_num_threads(args.threads)
    results = []
    for shape in args.shapes.split(","):
        if shape == "tiny":
            RANDOM_CONFIGS["tiny"] = TINY
        model, tok = random_model(shape, args.device, resolve_dtype("auto", args.device), args.tokenizer)
        rows = measure(model, tok, args, shape)
        for row in rows:
            print(row, flush=True)
        results += rows
    print(table(results, columns))
    print("wrote", write_json(name, {"device": args.device, "args": {k: str(v) for k, v in vars(args).items()},
                                     "results": results}))


if __name__ == "__main__":
    main()
