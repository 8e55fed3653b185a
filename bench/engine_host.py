"""Host (Python/CPU) time the engine spends per row per step, apart from the model and sampling.

On a GPU a decode step of a small model takes a few milliseconds; whatever the engine does on the
host around it (scheduling, building index tensors, detokenizing, stop checks, outputs) is paid
per row per step, and unless it is overlapped with the device it caps throughput at
rows / (host time + device time). This measures that host time on the CPU, where it is the
same code, with a one-layer random model so the forward pass is cheap, and times the forward
pass and sampling separately so that only the host part is reported:

    host µs per row = (step time - forward time - sampling time) / rows

split into scheduling, the update (detokenize, stop checks, outputs) and the rest ("prepare":
building the step's input tensors, plus freeing the step's tensors, which on a CPU with a large
vocabulary is itself visible: a 256-row logits tensor is 50 MB, mapped and unmapped each step).

Rows run greedy decode of 64-token prompts (prefill excluded: measured after it). Reported per
batch size: step ms, forward+sampling ms, host ms, host µs per row, and the throughput ceiling
host time alone allows (rows / host time). The ratio column compares host µs per row with the
16-row run of the same invocation (same machine, same run). For the GPU target (50k tok/s at
256 rows, SmolLM2-135M shape), host time at 256 rows must stay well under 5 ms a step, or be
overlapped with the device.

    .venv/bin/python bench/engine_host.py                  # rows 16,64,256
    .venv/bin/python bench/engine_host.py --rows 16,256 --steps 100
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
import transformers  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

from bench.common import table, write_json  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402
from worker.engine import Engine, EngineConfig, EngineRequest  # noqa: E402
from worker.engine import runner as runner_module  # noqa: E402
from worker.engine.model_files import SMOLLM2_GGUF, smollm2_dir  # noqa: E402


class Timed:
    """Wraps a callable and adds up the seconds spent in it."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t


def measure(model, tok, rows: int, steps: int) -> dict:
    engine = Engine(model, tok, EngineConfig(max_batch=rows, max_seq_len=64 + steps + 16, prefill_chunk=64 * rows))
    for i in range(rows):
        engine.add(EngineRequest(rid=f"r{i}", prompt_ids=[100 + (i + j) % 1000 for j in range(64)],
                                 params=SamplingParams(max_tokens=steps + 8, temperature=0.0), ignore_eos=True))
    for _ in range(3):  # prefill and warm-up
        engine.step()
    forward = Timed(engine.runner.decoder)
    sample = Timed(runner_module.sample)
    schedule = Timed(engine.scheduler.schedule)
    update = Timed(engine._update)
    engine.runner.decoder, runner_module.sample = forward, sample
    engine.scheduler.schedule, engine._update = schedule, update
    per_step = []
    try:
        for _ in range(steps):
            t = time.perf_counter()
            outs = engine.step()
            per_step.append(time.perf_counter() - t)
            assert len(outs) == rows
    finally:
        engine.runner.decoder, runner_module.sample = forward.fn, sample.fn
        del engine.scheduler.schedule, engine._update        # back to the class's methods
    total = sum(per_step)
    device = forward.seconds + sample.seconds
    host = total - device
    per_row = 1e6 / steps / rows
    return {
        "rows": rows, "steps": steps, "step_ms": 1000 * statistics.median(per_step),
        "forward_sample_ms": 1000 * device / steps, "host_ms": 1000 * host / steps,
        "host_us_per_row": host * per_row, "host_ceiling_tok_s": rows * steps / host,
        # where host time goes: deciding the step, turning outputs into text and results, and
        # the rest (building the step's inputs, freeing its tensors)
        "schedule_us_per_row": schedule.seconds * per_row, "update_us_per_row": update.seconds * per_row,
        "prepare_us_per_row": (host - schedule.seconds - update.seconds) * per_row,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16,64,256")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir()), gguf_file=SMOLLM2_GGUF)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    model.eval().requires_grad_(False)
    results = [measure(model, tok, int(r), args.steps) for r in args.rows.split(",")]
    base = results[0]["host_us_per_row"]
    for r in results:
        r["x_first_host_us_per_row"] = r["host_us_per_row"] / base
    print(table(results, ["rows", "steps", "step_ms", "forward_sample_ms", "host_ms", "host_us_per_row",
                          "x_first_host_us_per_row", "host_ceiling_tok_s", "schedule_us_per_row",
                          "prepare_us_per_row", "update_us_per_row"]))
    print("wrote", write_json("engine_host", {"args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
