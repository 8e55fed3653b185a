"""What a slow schema compile costs the other streams (worker.engine.grammar_compile), before and
after compiles moved off the engine thread, alternated in one process.

A tiny random engine (SmolLM2's tokenizer, 2 layers) decodes one stream; a request whose schema
is a large counted repetition (`minLength` ~10,000, ~1-2 s to compile, a fresh bound each time
so no cache answers) arrives. `none` is the baseline: no compile, a 2.5 s window of the stream
alone. `inline` compiles it in the stepping thread, as the engine did
before (`Grammars.matcher`); `pool` adds it to the engine, which compiles it on its compile
thread while the loop steps on; `pool0` the same with the compile threads at the engine's own CPU
priority (not niced: CompilePool.NICE = 0). Reported per run: the compile's wall time, the engine steps
completed while it ran, and the longest gap between two steps in that window. Runs alternate
(none, inline, pool, pool0, none, ...) so load drift falls on all of them.

Also measured: whether xgrammar holds the GIL while compiling: a pure-Python loop's iterations
per second alone and while a compile runs in another thread (a compile that held the GIL would
leave it ~0 while it runs; one that releases it leaves what the CPU share allows).

    .venv/bin/python bench/grammar_compile.py [--runs 3]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import table, write_json  # noqa: E402

_bound = itertools.count(10_000 + int(time.time()) % 5000 * 3)


def slow_spec() -> dict:
    return {"type": "json_schema", "schema": {"type": "object", "properties": {
        "a": {"type": "string", "minLength": next(_bound)}}, "required": ["a"]}}


def window(stamps: list[float], start: float, end: float) -> tuple[int, float]:
    """(steps ended in [start, end], the longest gap between consecutive step ends around it)."""
    inside = [t for t in stamps if start <= t <= end]
    around = [max([t for t in stamps if t < start], default=start)] + inside + \
             [min([t for t in stamps if t > end], default=end)]
    return len(inside), max(b - a for a, b in zip(around, around[1:]))


def one_run(engines, tok, mode: str, n: int) -> dict:
    engine = engines[mode]
    from shared.sampling import SamplingParams
    from worker.engine import EngineRequest
    stamps: list[float] = []
    rid = f"{mode}{n}"
    engine.add(EngineRequest("s" + rid, tok("Once upon a time")["input_ids"],
                             SamplingParams(max_tokens=100_000 // 100, temperature=0.0), ignore_eos=True))
    for _ in range(20):            # the stream is decoding
        engine.step()
        stamps.append(time.perf_counter())
    spec = slow_spec()
    start = time.perf_counter()
    if mode == "none":             # no compile: the stream's own gaps over a window as long
        while time.perf_counter() - start < 2.5:
            engine.step()
            stamps.append(time.perf_counter())
        end = time.perf_counter()
    elif mode == "inline":           # the engine before: the compile ran in its own thread's step
        engine.grammars.matcher(spec)
        end = time.perf_counter()
    else:                          # pool: niced compile threads (CompilePool.NICE); pool0: not niced
        engine.add(EngineRequest(rid, tok("JSON:")["input_ids"], SamplingParams(max_tokens=2, grammar=spec)))
        job = engine.compile_of(rid)
        while not job.future.done():
            engine.step()
            stamps.append(time.perf_counter())
        end = time.perf_counter()
    for _ in range(20):
        engine.step()
        stamps.append(time.perf_counter())
    engine.cancel("s" + rid)
    while engine.has_work:
        engine.step()
    steps, gap = window(stamps, start, end)
    return {"mode": mode, "compile_s": end - start, "steps_during": steps, "max_gap_ms": gap * 1000}


def gil_probe(engine) -> dict:
    """Python loop iterations/s alone, then while a compile runs in another thread."""
    def spin(until) -> float:
        t0, n = time.perf_counter(), 0
        while not until():
            n += 1
            sum(range(100))
        return n / (time.perf_counter() - t0)
    end = time.perf_counter() + 1.0
    alone = spin(lambda: time.perf_counter() > end)
    done = threading.Event()
    spec = slow_spec()
    thread = threading.Thread(target=lambda: (engine.grammars.matcher(spec), done.set()))
    thread.start()
    during = spin(done.is_set)
    thread.join()
    return {"loop_per_s_alone": alone, "loop_per_s_during_compile": during, "ratio": during / alone}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    import torch
    from transformers import AutoTokenizer

    from tests.tiny_model import make_tiny_model_dir, tiny_llama
    from worker.engine import Engine, EngineConfig
    from worker.engine.grammar_compile import GrammarLimits
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(str(make_tiny_model_dir(Path(tempfile.gettempdir()) / "bench-tiny-model")))
    model = tiny_llama(tok)
    modes = ("none", "inline", "pool", "pool0")
    engines = {}
    for mode in modes:
        engines[mode] = engine = Engine(model, tok, EngineConfig(max_batch=4, max_seq_len=2048, prefill_chunk=64,
                                                                 grammar=GrammarLimits(compile_timeout_s=600)))
        if mode == "pool0":
            engine.grammars.compile_pool.NICE = 0
        engine.grammars.matcher({"type": "json_object"})     # the token table is built once, outside the runs
    rows = [one_run(engines, tok, mode, n) for n in range(args.runs) for mode in modes]
    gil = gil_probe(engines["inline"])
    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
    print(cpu)
    print(table(rows, ["mode", "compile_s", "steps_during", "max_gap_ms"]))
    summary = {mode: {"steps_during_median": statistics.median(r["steps_during"] for r in rows if r["mode"] == mode),
                      "max_gap_ms_median": statistics.median(r["max_gap_ms"] for r in rows if r["mode"] == mode)}
               for mode in modes}
    print(summary)
    print("GIL probe:", {k: round(v, 3) for k, v in gil.items()})
    print("wrote", write_json("grammar_compile", {"cpu": cpu, "runs": rows, "summary": summary, "gil": gil}))


if __name__ == "__main__":
    main()
