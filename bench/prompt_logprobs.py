"""What prompt logprobs (completions `echo` + `logprobs`, lm-evaluation-harness's loglikelihood
requests) cost a prefill step: the engine's time for one step that prefills `--rows` prompts of
`--prompt` tokens (and samples each one token, `max_tokens: 1`, as lm-eval asks), with 0 (the
baseline), 8 and all of the rows asking for prompt logprobs (`--top` alternatives each), in the
same run.

The cost must fall only on the rows that ask: 0 asking pays an attribute test per prefill chunk;
k asking pay the head (lm_head) over their prompt positions instead of one row each, a
log-softmax's logsumexp, a gather and a top-k of those rows, one transfer, and on the host each
prompt token's entry. The configurations share one model (random weights of a real shape, or
`tiny`: SmolLM2's 49k vocabulary under a 2-layer 64-wide model, where the forward pass is cheap,
as on a GPU, and the head's work shows most), each its own engine (prefix caching off: the
prompts are new each time anyway); their steps are interleaved, so machine noise falls on every
configuration alike. Median of `--reps`.

    .venv/bin/python bench/prompt_logprobs.py                    # CPU, tiny and SmolLM2-135M's shape
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import table, write_json  # noqa: E402
from bench.logprobs import parser, run_shapes  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402
from worker.engine import Engine, EngineConfig, EngineRequest  # noqa: E402


def prefill_step(engine: Engine, args, asking: int, rep: int) -> float:
    """Seconds of the one step that prefills `args.rows` new prompts, the first `asking` asking."""
    for i in range(args.rows):
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=args.top if i < asking else None,
                                prompt_logprobs=args.top if i < asking else None, echo=i < asking)
        prompt = [1 + (rep * 131 + i * 7 + j) % 40000 for j in range(args.prompt)]
        engine.add(EngineRequest(f"{rep}-{i}", prompt, params, ignore_eos=True))
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    outs = engine.step()
    sync()
    took = time.perf_counter() - t
    assert len(outs) == args.rows and sum(o.prompt is not None for o in outs) == asking and not engine.has_work
    return took


def measure(model, tok, args, shape: str) -> list[dict]:
    counts = [int(a) for a in args.asking.split(",")]
    config = EngineConfig(max_batch=args.rows, max_seq_len=args.prompt + 8, prefill_chunk=args.rows * args.prompt,
                          device=args.device, dtype=model.dtype, prefix_caching=False)
    engines = {a: Engine(model, tok, config) for a in counts}
    for a, engine in engines.items():   # warm-up
        prefill_step(engine, args, a, -1)
    times: dict[int, list[float]] = {a: [] for a in counts}
    for rep in range(args.reps):
        for a, engine in engines.items():     # interleaved: noise falls on every configuration
            times[a].append(prefill_step(engine, args, a, rep))
    base = statistics.median(times[counts[0]])
    return [{"shape": shape, "rows": args.rows, "prompt": args.prompt, "asking": a, "top": args.top,
             "step_ms": round(1000 * statistics.median(times[a]), 3),
             "x_none_asking": round(statistics.median(times[a]) / base, 3)} for a in counts]


def main() -> None:
    ap = parser(__doc__)      # (its --prompt: the prompt length; --steps and --temperature unused here)
    ap.set_defaults(prompt=16)
    ap.add_argument("--asking", default="0,8,64", help="rows asking for prompt logprobs (first: the baseline)")
    ap.add_argument("--top", type=int, default=1, help="alternatives per prompt token (lm-eval asks 1)")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    results = run_shapes(args, measure)
    print(table(results, ["shape", "rows", "prompt", "asking", "top", "step_ms", "x_none_asking"]))
    print("wrote", write_json("prompt_logprobs", {"device": args.device,
                                                  "args": {k: str(v) for k, v in vars(args).items()},
                                                  "results": results}))


if __name__ == "__main__":
    main()
