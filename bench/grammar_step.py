"""What structured output costs a decode step: 64 decoding rows with 0, 8 and 64 of them
constrained by a JSON schema grammar (worker.engine.grammar), the baseline (0) in the same run.

Every row decodes every timed step: EOS is masked and the schema (an object whose one string
is at least 200 characters long) cannot end before the timed steps do, while inside the string
most of the 49k tokens are allowed: the mask is filled and applied in full each step (a string
body is the expensive case). The configurations are measured in turn, twice over
(0, 8, 64, 0, 8, 64) after an uncounted warm-up, so drift falls on all of them; each figure is
the median of its steps.
Also timed: the grammar's own share of a step (`Grammars.apply_masks`: host mask fill, upload,
device apply).

    .venv/bin/python bench/grammar_step.py                    # CPU, SmolLM2's shape, random weights
    python bench/grammar_step.py --device cuda --tokenizer DIR
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

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 200}}, "required": ["text"]}


def measure(model, tok, device: str, rows: int, constrained: int, steps: int, prompt: int) -> dict:
    import torch

    from shared.sampling import SamplingParams
    from worker.engine import Engine, EngineConfig, EngineRequest
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    engine = Engine(model, tok, EngineConfig(max_batch=rows, max_seq_len=prompt + steps + 64, prefill_chunk=4096,
                                             device=device, dtype=model.dtype))
    grammar = {"type": "json_schema", "schema": SCHEMA}
    for i in range(rows):
        params = SamplingParams(max_tokens=steps + 32, temperature=0.0, grammar=grammar if i < constrained else None)
        engine.add(EngineRequest(str(i), [1 + (i * 7 + j) % 40000 for j in range(prompt)], params, ignore_eos=True))
    while engine.num_waiting or any(s.pending > 1 or s.computed == 0 for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    sync()
    mask_s: list[float] = []
    apply = engine.grammars.apply_masks

    def timed(logits, rows, matchers):
        sync()
        t = time.perf_counter()
        apply(logits, rows, matchers)
        sync()
        mask_s.append(time.perf_counter() - t)
    engine.grammars.apply_masks = timed   # the runner's grammars are the engine's: it calls this
    step_s = []
    for _ in range(steps):
        t = time.perf_counter()
        outs = engine.step()
        step_s.append(time.perf_counter() - t)
        assert len(outs) == rows and not any(o.finished for o in outs), "a row stopped decoding"
    return {"step_s": step_s, "mask_s": mask_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--random-weights", default="smollm2-135m")
    ap.add_argument("--tokenizer", default="", help="a saved tokenizer directory instead of SmolLM2's GGUF")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--constrained", default="0,8,64")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import torch

    from bench.engine import random_model
    from worker.engine.config import resolve_dtype
    model, tok = random_model(args.random_weights, args.device, resolve_dtype("auto", args.device), args.tokenizer)
    counts = [int(c) for c in args.constrained.split(",")]
    samples = {c: {"step_s": [], "mask_s": []} for c in counts}
    measure(model, tok, args.device, args.rows, counts[-1], 3, args.prompt)   # warm-up, not counted
    for _ in range(args.rounds):
        for c in counts:
            got = measure(model, tok, args.device, args.rows, c, args.steps, args.prompt)
            for k in got:
                samples[c][k] += got[k]
    base = statistics.median(samples[counts[0]]["step_s"])
    results = []
    for c in counts:
        step = statistics.median(samples[c]["step_s"])
        mask = statistics.median(samples[c]["mask_s"]) if c else 0.0
        results.append({"rows": args.rows, "constrained": c, "step_ms": step * 1e3, "vs_baseline": step / base,
                        "grammar_ms": mask * 1e3, "grammar_per_row_us": mask / c * 1e6 if c else 0.0})
    print(f"device {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}), "
          f"{args.random_weights} random weights, {args.rows} decoding rows, median of {args.steps * args.rounds} steps")
    print(table(results, ["rows", "constrained", "step_ms", "vs_baseline", "grammar_ms", "grammar_per_row_us"]))
    path = write_json(f"grammar_step_{args.device}", {"args": vars(args), "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
