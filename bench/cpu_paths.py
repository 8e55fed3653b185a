"""float32 against int4 (with the 8-bit-activation kernels where timed in) for one user on this
CPU: SmolLM2 loaded both ways in one process, a decode step of each stepped alternately in
blocks (a VM's speed moves within seconds: alternation gives both the same luck), and a prompt's
time to its first token. What `QUANTIZATION=auto` chooses between (worker/engine/config.py).

An AVX2-only CPU can be emulated on a newer one: torch's kernels and oneDNN held to AVX2 by
their environment variables (read at import), the 8-bit-activation kernels by `--isa avx2`:

    .venv/bin/python bench/cpu_paths.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python bench/cpu_paths.py --isa avx2
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
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens (timed to the first token; one chunk)")
    ap.add_argument("--block", type=int, default=8, help="decode steps of one model before switching")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--isa", default="best", choices=["best", "avx2"], help="the 8-bit-activation kernels' path")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.sampling import SamplingParams
    from worker.engine import Engine, EngineConfig, EngineRequest, q8_kernels
    from worker.engine.cpu_kernels import cpu_model
    from worker.engine.model_files import resolve_model
    from worker.engine.quantize import quantize_int4

    torch.set_num_threads(args.threads)
    if q8_kernels.load() is not None:
        q8_kernels.load().set_instruction_set(args.isa)
    directory, gguf = resolve_model("", "")
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=gguf)

    def engine(model, chunk: int) -> Engine:
        return Engine(model, tok, EngineConfig(max_batch=1, max_seq_len=args.prompt + 4096, prefill_chunk=chunk,
                                               device="cpu", dtype=model.dtype))

    prompt = [1 + (j * 13) % 40000 for j in range(args.prompt)]
    engines, first_token_ms = {}, {}
    for kind in ("float32", "int4"):
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32).eval()
        if kind == "int4":
            quantize_int4(model, torch.bfloat16, dense_rows=-1, q8_rows=-1)
        timed = []
        for _ in range(2):
            once = engine(model, args.prompt)
            once.add(EngineRequest("p", prompt, SamplingParams(max_tokens=1, temperature=0.0), ignore_eos=True))
            t = time.perf_counter()
            while once.has_work:
                once.step()
            timed.append(1000 * (time.perf_counter() - t))
        first_token_ms[kind] = min(timed)
        running = engine(model, args.prompt)
        running.add(EngineRequest("d", prompt, SamplingParams(max_tokens=args.block * (args.blocks + 1) + 8,
                                                              temperature=0.0), ignore_eos=True))
        while running.num_waiting or any(s.pending > 1 or s.computed == 0 for s in running.scheduler.running):
            running.step()
        engines[kind] = running
    steps: dict[str, list[float]] = {kind: [] for kind in engines}
    for _ in range(args.blocks):
        for kind, running in engines.items():
            running.step()   # untimed: the switch's cold caches
            for _ in range(args.block):
                t = time.perf_counter()
                running.step()
                steps[kind].append(1000 * (time.perf_counter() - t))
    rows = [{"model": kind, "decode_step_ms": round(statistics.median(steps[kind]), 2),
             "decode_p95_ms": round(sorted(steps[kind])[int(0.95 * len(steps[kind]))], 2),
             "first_token_ms": round(first_token_ms[kind], 1)} for kind in engines]
    print(table(rows, ["model", "decode_step_ms", "decode_p95_ms", "first_token_ms"]))
    cpu = cpu_model()
    isa = q8_kernels.load().instruction_set() if q8_kernels.load() is not None else "none"
    print(f"CPU: {cpu}; torch kernels: {torch.backends.cpu.get_cpu_capability()}; 8-bit-activation path: {isa}; "
          f"threads: {args.threads}")
    print(f"\nwrote {write_json('cpu_paths', {'cpu': cpu, 'isa': isa, 'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
