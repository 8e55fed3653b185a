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


def engine_with(model, tok, args, params_of) -> Engine:
    """`args.rows` requests decoding (prompts computed), request i sampling with `params_of(i)`."""
    engine = Engine(model, tok, EngineConfig(max_batch=args.rows, max_seq_len=args.prompt + args.steps + 32,
                                             prefill_chunk=4096, device=args.device, dtype=model.dtype))
    for i in range(args.rows):
        engine.add(EngineRequest(str(i), [1 + (i * 7 + j) % 40000 for j in range(args.prompt)], params_of(i),
                                 ignore_eos=True))
    while engine.num_waiting or any(s.pending > 1 or s.computed == 0 for s in engine.scheduler.running):
        engine.step()
    for _ in range(2):
        engine.step()
    return engine


def step_times(engines: dict, args, check=lambda key, outs: None, clock=time.perf_counter) -> dict:
    """Each engine's step times over `args.steps` rounds, their steps interleaved so that machine
    noise falls on every configuration alike; `check(key, outputs)` after each step. `clock`:
    wall time by default; `time.thread_time` leaves out the time the machine's other jobs held
    the CPU (one torch thread, on CPU: the step runs on this thread)."""
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times: dict = {key: [] for key in engines}
    for _ in range(args.steps):
        for key, engine in engines.items():
            sync()
            t = clock()
            outs = engine.step()
            sync()
            times[key].append(clock() - t)
            check(key, outs)
    return times


def measure(model, tok, args, shape: str) -> list[dict]:
    counts = [int(a) for a in args.asking.split(",")]
    engines = {a: engine_with(model, tok, args, lambda i, a=a: SamplingParams(
        max_tokens=args.steps + 16, temperature=args.temperature, logprobs=args.top if i < a else None))
        for a in counts}

    def check(a, outs):
        assert sum(o.logprobs is not None for o in outs) == a
    times = step_times(engines, args, check)
    base = statistics.median(times[counts[0]])
    return [{"shape": shape, "rows": args.rows, "asking": a, "top": args.top,
             "step_ms": round(1000 * statistics.median(times[a]), 3),
             "x_none_asking": round(statistics.median(times[a]) / base, 3)} for a in counts]


def parser(doc: str) -> argparse.ArgumentParser:
    """The arguments of the per-row cost benches (this one, bench/penalties.py)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shapes", default="tiny,smollm2-135m", help=f"tiny or of {sorted(RANDOM_CONFIGS)}")
    ap.add_argument("--tokenizer", default="", help="a saved tokenizer directory instead of SmolLM2's GGUF")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest on a shared machine)")
    return ap


def run_shapes(args, measure) -> list[dict]:
    """`measure(model, tokenizer, args, shape)`'s rows for each of `args.shapes`, printed as they come."""
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
    return results


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--asking", default="0,8,64", help="rows asking for logprobs, per configuration (first: baseline)")
    ap.add_argument("--top", type=int, default=5, help="top_logprobs of the rows that ask")
    args = ap.parse_args()
    results = run_shapes(args, measure)
    print(table(results, ["shape", "rows", "asking", "top", "step_ms", "x_none_asking"]))
    print("wrote", write_json("logprobs", {"device": args.device, "args": {k: str(v) for k, v in vars(args).items()},
                                           "results": results}))


if __name__ == "__main__":
    main()
