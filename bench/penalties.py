"""What penalties and logit bias cost a decode step: the engine's step time at `--rows` decoding
rows with 0 (the baseline), 8 and all of them using presence + frequency + repetition penalties
and a `--bias`-entry logit_bias, in the same run.

The cost must fall only on the rows that use them (worker.engine.penalties, logit_bias): 0 using
pays three integer tests per step; k using pay, on the device, a gather of their [k, vocab]
counts and seen masks, the penalty arithmetic on their logits (a float32 copy of the step's
logits), one scatter_add of their bias, and after sampling one index_put of the sampled ids into
their counts. Three engines share one model (random weights of a real shape, or `tiny`: the
same 49k vocabulary under a 2-layer 64-wide model, where the forward pass is cheap, as on a GPU,
and the sampling work shows most), all rows prefilled, EOS masked; their steps are interleaved,
so machine noise falls on every configuration alike. Median of `--steps`, timed in this
thread's CPU time on a CPU with one torch thread (what the step itself costs, not the time the
machine's other jobs took from it), else in wall time. A second table times
the added work alone, without the forward pass whose noise hides it on a loaded machine: each
engine's bias + penalties on a [rows, vocab] float32 logits tensor, then `record` of the argmax
ids (the rows' state restored after each round, untimed), interleaved the same way; best of
10 x `--steps` rounds (the machine's noise only ever adds), and the extra over the 0-using engine (whose
figure is the argmax alone).

    .venv/bin/python bench/penalties.py                          # CPU, SmolLM2-135M's shape and tiny
    python bench/penalties.py --device cuda --shapes smollm2-135m --tokenizer DIR
"""

from __future__ import annotations

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
from bench.logprobs import engine_with, parser, run_shapes, step_times  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402


def measure(model, tok, args, shape: str) -> list[dict]:
    counts = [int(a) for a in args.using.split(",")]
    bias = {100 + 37 * j: (-1) ** j * 2.0 for j in range(args.bias)}

    def params_of(using: int):
        def of(i: int) -> SamplingParams:
            controls = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1,
                            logit_bias=bias or None) if i < using else {}
            return SamplingParams(max_tokens=args.steps + 16, temperature=args.temperature, **controls)
        return of
    engines = {u: engine_with(model, tok, args, params_of(u)) for u in counts}
    for u, engine in engines.items():
        assert engine.runner.batch.penalties.num_active == u and engine.runner.batch.bias.num_biased == u * bool(bias)
    clock = time.thread_time if args.device == "cpu" and args.threads == 1 else time.perf_counter
    times = step_times(engines, args, clock=clock)
    base = statistics.median(times[counts[0]])
    added = added_times(engines, args, clock)
    return [{"shape": shape, "rows": args.rows, "using": u, "bias_ids": args.bias,
             "step_ms": round(1000 * statistics.median(times[u]), 3),
             "x_none_using": round(statistics.median(times[u]) / base, 3),
             "sampler_ms_best": round(1000 * min(added[u]), 3),
             "sampler_extra_ms": round(1000 * (min(added[u]) - min(added[counts[0]])), 3)} for u in counts]


def added_times(engines: dict, args, clock) -> dict:
    """The runner's bias + penalties + record work alone, per engine, on one logits tensor."""
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times: dict = {u: [] for u in engines}
    first = next(iter(engines.values()))
    logits = torch.randn(args.rows, first._logits_width,
                         device=first.device)
    for _ in range(10 * args.steps):
        for u, engine in engines.items():
            batch = engine.runner.batch
            pen = batch.penalties
            slots = np.array([seq.slot for seq in engine.scheduler.running], dtype=np.int64)
            saved = None if pen.ids is None else (pen.ids.clone(), pen.counts.clone(), pen.n.clone(), pen.length.copy())
            work = logits.clone()
            sync()
            t = clock()
            if pen.num_active or batch.bias.num_biased:
                batch.bias.apply(work, slots)
                if pen.num_active:
                    pen.apply(work, slots)
            tokens = work.max(dim=-1).indices
            if pen.num_active:
                pen.record(slots, tokens)
            sync()
            times[u].append(clock() - t)
            if saved is not None:
                pen.ids.copy_(saved[0]), pen.counts.copy_(saved[1]), pen.n.copy_(saved[2])
                pen.length[:] = saved[3]
    return times


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--using", default="0,8,64", help="rows using penalties + bias, per configuration (first: baseline)")
    ap.add_argument("--bias", type=int, default=16, help="logit_bias entries of the rows that use it")
    args = ap.parse_args()
    results = run_shapes(args, measure)
    print(table(results, ["shape", "rows", "using", "bias_ids", "step_ms", "x_none_using", "sampler_ms_best",
                          "sampler_extra_ms"]))
    print("wrote", write_json("penalties", {"device": args.device, "args": {k: str(v) for k, v in vars(args).items()},
                                            "results": results}))


if __name__ == "__main__":
    main()
