"""Per-token cost of incremental detokenization: the Rust `DecodeStream` path against our own
two-decode window (the baseline), same tokens, same process, alternating.

The engine detokenizes every row's token every step, so this is host time per row per step
(bench/engine_host.py measures all of it; this isolates the detokenizer, which is less noisy).
Token streams: SmolLM2's tokens of mixed text (accents, CJK, emoji, code) and random ids.

    .venv/bin/python bench/detokenize.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import transformers  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from bench.common import table, write_json  # noqa: E402
from worker.engine.detokenize import IncrementalDetokenizer  # noqa: E402
from worker.engine.model_files import SMOLLM2_GGUF, smollm2_dir  # noqa: E402

TEXT = "Héllo wörld! 日本語のテキスト 🙂🚀 emoji, code: def f(x): return x**2  \n\n  spaces. "


def per_token_us(tok, prompt: list[int], ids: list[int], stream: bool) -> float:
    detok = IncrementalDetokenizer(tok, prompt, stop=[])
    if not stream:
        detok._stream = None
    t = time.perf_counter()
    for i in ids:
        detok.add(i)
    detok.finish()
    return 1e6 * (time.perf_counter() - t) / len(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir()), gguf_file=SMOLLM2_GGUF)
    rng = random.Random(0)
    streams = {"text": tok(TEXT * 40, add_special_tokens=False)["input_ids"],
               "random ids": [rng.randrange(len(tok)) for _ in range(3000)]}
    prompt = tok("Say something:", add_special_tokens=False)["input_ids"]
    results = []
    for name, ids in streams.items():
        window, stream = [], []
        for _ in range(args.repeat):
            window.append(per_token_us(tok, prompt, ids, stream=False))
            stream.append(per_token_us(tok, prompt, ids, stream=True))
        row = {"tokens": name, "n": len(ids), "window_us": round(statistics.median(window), 2),
               "stream_us": round(statistics.median(stream), 2)}
        row["x_window"] = round(row["stream_us"] / row["window_us"], 3)
        results.append(row)
    print(table(results, ["tokens", "n", "window_us", "stream_us", "x_window"]))
    print("wrote", write_json("detokenize", {"args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
