"""One decode step of the real SmolLM2 (4-bit projections, 8-bit head) with torch's packed kernels
against llama.cpp's arithmetic (8-bit activations, worker/engine/q8_kernels.py), in one process:
two engines over the same loaded model, one built with each kernel, stepped alternately in
blocks so that both see the same machine (a VM's neighbours move a core's speed by tens of
percent within seconds; separate runs were useless here). Reports the median step per kernel,
their ratio, and the CPU model.

    .venv/bin/python bench/q8_kernels.py --rows 1,2,4 --threads 1,2
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4", help="decode rows a step (requests in the batch)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--block", type=int, default=8, help="steps of one kernel before switching")
    ap.add_argument("--blocks", type=int, default=10, help="blocks per kernel")
    ap.add_argument("--isa", default="best", choices=["best", "avx2"],
                    help="avx2: the kernels' AVX2 path even on a VNNI CPU (what an AVX2-only CPU runs)")
    args = ap.parse_args()

    import torch

    from shared.config import Settings
    from shared.sampling import SamplingParams
    from worker.engine import Engine, EngineConfig, EngineRequest, load_model
    from worker.engine.cpu_kernels import cpu_model
    from worker.engine.quantize import Int4Linear, Int8SplitLinear

    rows_list = [int(r) for r in args.rows.split(",")]
    # every count timed runs on 8-bit activations when asked: the copies are kept for all
    model, tok = load_model(Settings(model_path="", int4_q8_rows=max(rows_list) + 1))
    from worker.engine import q8_kernels
    if q8_kernels.load() is not None:
        q8_kernels.load().set_instruction_set(args.isa)
    linears = [m for m in model.modules() if isinstance(m, Int4Linear)]
    head = model.lm_head if isinstance(model.lm_head, Int8SplitLinear) else None
    if not linears or linears[0].q8 is None:
        raise SystemExit("the 8-bit-activation kernels are not built or not used for this model here")

    def use(q8: bool) -> None:
        below = max(rows_list) + 1 if q8 else 0
        for linear in linears:
            linear.q8_below_rows = below
        if head is not None:
            head.q8_below_rows = below

    results = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for rows in rows_list:
            engines = {}
            for kind in ("torch", "q8"):
                use(kind == "q8")   # the decoder's projections read it when an engine is built
                engine = Engine(model, tok, EngineConfig(max_batch=rows, max_seq_len=args.prompt + 4096,
                                                         prefill_chunk=4096, device="cpu", dtype=model.dtype))
                for i in range(rows):
                    engine.add(EngineRequest(f"{kind}{i}", [1 + (i * 7 + j) % 40000 for j in range(args.prompt)],
                                             SamplingParams(max_tokens=args.block * args.blocks + 64, temperature=0.0),
                                             ignore_eos=True))
                while engine.num_waiting or any(s.pending > 1 or s.computed == 0 for s in engine.scheduler.running):
                    engine.step()
                engines[kind] = engine
            times: dict[str, list[float]] = {"torch": [], "q8": []}
            for _ in range(args.blocks):
                for kind, engine in engines.items():
                    use(kind == "q8")   # the head reads it at every call
                    torch.set_num_threads(threads)
                    engine.step()   # untimed: the switch's cold caches
                    for _ in range(args.block):
                        t = time.perf_counter()
                        engine.step()
                        times[kind].append(time.perf_counter() - t)
            torch_ms, q8_ms = (1000 * statistics.median(times[k]) for k in ("torch", "q8"))
            results.append({"threads": threads, "rows": rows, "torch_step_ms": round(torch_ms, 2),
                            "q8_step_ms": round(q8_ms, 2), "q8_speedup": round(torch_ms / q8_ms, 2),
                            "torch_p95_ms": round(1000 * sorted(times["torch"])[int(0.95 * len(times["torch"]))], 2),
                            "q8_p95_ms": round(1000 * sorted(times["q8"])[int(0.95 * len(times["q8"]))], 2)})
            print(results[-1], flush=True)
            del engines
    print()
    print(table(results, ["threads", "rows", "torch_step_ms", "q8_step_ms", "q8_speedup", "torch_p95_ms", "q8_p95_ms"]))
    cpu = cpu_model()
    isa = q8_kernels.load().instruction_set()
    print(f"CPU: {cpu}; 8-bit-activation path: {isa}")
    print(f"\nwrote {write_json('q8_kernels', {'cpu': cpu, 'isa': isa, 'args': vars(args), 'rows': results})}")


if __name__ == "__main__":
    main()
