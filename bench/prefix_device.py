"""Prefix caching on any device, random weights: bench/prefix.py's `system` workload (requests
sharing one long system prompt, each with its own short question, forced answer lengths) with
the engine's prefix cache on and off, for a machine that has no SmolLM2 GGUF (a GPU box reached
with a small upload): the model is a real shape with random weights (bench/engine.py
`random_model`; cache hits and TTFT do not depend on weight values) and SmolLM2's tokenizer from
a saved directory. Engines as bench/prefix.py builds them (`EngineConfig.from_settings` with the
worker's defaults for the device: on CUDA bf16, CUDA graphs, an 8192-token prefill chunk).
Reported: TTFT of request 1 (fills the cache) and p50/p95 of requests 2..N, prompt tokens
computed.

    python bench/prefix_device.py --device cuda --tokenizer DIR
    .venv/bin/python bench/prefix_device.py --requests 2 --system-tokens 100 --answer-tokens 2   # CPU smoke
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import table, write_json  # noqa: E402
from bench.engine import RANDOM_CONFIGS, random_model  # noqa: E402
from bench.prefix import run_engine, system_sessions, system_workload  # noqa: E402
from worker.engine.config import resolve_dtype  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--random-weights", default="smollm2-135m", choices=sorted(RANDOM_CONFIGS))
    ap.add_argument("--tokenizer", default="", help="a saved tokenizer directory instead of SmolLM2's GGUF")
    ap.add_argument("--methods", default="engine-on,engine-off")
    ap.add_argument("--modes", default="sequential,concurrent")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = ap.parse_args()
    args.quantization = "none"   # random float weights: nothing to quantize (run_engine reads it)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = random_model(args.random_weights, args.device, resolve_dtype("auto", args.device), args.tokenizer)
    # warm-up outside the timings, as bench/prefix.py does: a long prompt in full, short prompts
    # after a cached prefix, then decode rows (on CUDA: Triton compiles, graph pools, cuBLAS handles)
    warm = argparse.Namespace(**{**vars(args), "requests": 3, "system_tokens": min(600, args.system_tokens)})
    for concurrent in (False, True):
        run_engine(model, tok, system_sessions(tok, warm, concurrent), 4, True, True, args)
    methods = [m for m in args.methods.split(",") if m]
    rows = []
    for mode in args.modes.split(","):
        print(f"[system {mode}] {args.requests} requests, {args.system_tokens}-token system prompt", flush=True)
        rows += system_workload(mode, methods, model, tok, args)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\ndevice {args.device} ({name}), {args.random_weights} random weights ({model.dtype})")
    print(table(rows, ["workload", "method", "requests", "prompt_tokens", "computed", "hit_rate", "ttft_first_ms",
                       "ttft_p50_ms", "ttft_p95_ms", "off_p50_ratio", "seconds"]))
    path = write_json(f"prefix_{args.device}", {"model": f"random {args.random_weights} ({model.dtype})",
                                                "device_name": name, "args": vars(args), "system": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
