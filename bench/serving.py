"""One user and loaded, as users measure serving: guidellm (the vLLM project's serving benchmark)
against the whole stack's OpenAI API and against llama.cpp's server, beside the same load on the
engine alone and on the stack's WebSocket, interleaved in one run on one machine.

Targets (each row of the table is one target under one profile):
  engine    - worker.engine.Engine in this process, built as the worker builds it (same model,
              quantization and torch threads), fed the same shape of load: the ceiling
  openai    - guidellm's openai_http backend against the stack's gateway (chat completions, its
              default request shape: it checks /health, sends ignore_eos and continuous usage)
  ws        - the stack's WebSocket (/v1/stream), the protocol's own clients' way in
  llamacpp  - guidellm against llama.cpp's server on the same GGUF (--llamacpp-url; build and
              start it as bench/RESULTS.md says, with its default prompt cache, as ours is on)

Profiles: sync (one request at a time), c4 and c16 (that many in flight, closed loop). Every
request has a prompt of --prompt-tokens tokens (distinct text each, so no target serves one
from a prefix cache: the same cache policy for all) and --output-tokens output tokens (EOS
ignored). Reported per row: output tokens/s (all output tokens / wall time of the profile), TTFT
p50/p95, ITL p50/p95 (per request: (last token - first token) / (tokens - 1), guidellm's
definition), the stack's ratios to the engine alone in the same run, and the cores each side
used over the row (`client_cores`: the load generator, this process or guidellm, which shares
the box; `stack_cores`: Redis, gateway, worker and engine process).

The stack is started here as scripts/serve.sh runs it (scripts/stack.py: a local Redis, one
gateway, one worker, SmolLM2 on CPU, the embedded defaults), unless --url names a running one.
`--worker-env K=V` (repeatable) sets the worker's environment, e.g. TORCH_THREADS=2, to compare
a policy with the default: run the script once per setting and compare rows.

    .venv/bin/python bench/serving.py --llamacpp-url http://127.0.0.1:8090
    .venv/bin/python bench/serving.py --profiles sync --requests 4 --targets engine,openai,ws   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import percentile, table, write_json  # noqa: E402
from worker.engine.threads import bound_openmp_spin  # noqa: E402

bound_openmp_spin()   # the engine target's OpenMP as the worker's (before torch loads)

MODEL = "SmolLM2-135M-Instruct"
PROFILES = {"sync": 1, "c4": 4, "c16": 16}
WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy").split()


def prompt_texts(tok, count: int, tokens: int, seed: int) -> list[str]:
    """`count` distinct texts of `tokens` tokens each (as the chat's user message)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        words = [f"{seed}-{i}:"] + [rng.choice(WORDS) for _ in range(tokens)]
        while len(tok(" ".join(words)).input_ids) > tokens:
            words.pop()
        out.append(" ".join(words))
    return out


def summarize(name: str, profile: str, records: list[tuple[float, float, float, int]], errors: int = 0,
              duration: float | None = None) -> dict:
    """records: (start, first token, last token, tokens) per request, perf_counter seconds."""
    ok = [r for r in records if r[3] > 0]
    ttft = [1000 * (r[1] - r[0]) for r in ok]
    itl = [1000 * (r[2] - r[1]) / (r[3] - 1) for r in ok if r[3] > 1]
    if duration is None:
        duration = max(r[2] for r in ok) - min(r[0] for r in ok) if ok else float("nan")
    return {"target": name, "profile": profile, "requests": len(ok), "errors": errors,
            "out_tokens": sum(r[3] for r in ok), "out_tok_s": round(sum(r[3] for r in ok) / duration, 2) if ok else 0.0,
            "ttft_p50_ms": round(percentile(ttft, 50), 1), "ttft_p95_ms": round(percentile(ttft, 95), 1),
            "itl_p50_ms": round(percentile(itl, 50), 2), "itl_p95_ms": round(percentile(itl, 95), 2)}


# ---------------------------------------------------------------- targets

class EngineTarget:
    """The engine alone, as the worker builds it (worker.service's settings and thread policy)."""

    def __init__(self, settings, max_batch: int):
        from worker.engine import Engine, EngineConfig, load_model
        from worker.engine.config import default_prefill_chunk
        from worker.engine.threads import apply_torch_threads, wide_torch_threads
        self.threads = apply_torch_threads(settings)
        self.model, self.tok = load_model(settings)
        kind = self.model.device.type
        self.engine = Engine(self.model, self.tok, EngineConfig(
            max_batch=max_batch, max_seq_len=settings.max_seq_len, prefill_chunk=default_prefill_chunk(kind),
            device=kind, dtype=self.model.dtype, wide_threads=wide_torch_threads(settings, kind),
            wide_from_tokens=settings.torch_wide_from_tokens))

    def run(self, texts: list[str], concurrency: int, output: int) -> list[tuple]:
        from shared.sampling import SamplingParams
        from worker.engine import EngineRequest, build_prompt_ids
        queue = list(enumerate(texts))
        live: dict[str, list] = {}
        records = []
        while queue or live:
            while queue and len(live) < concurrency:
                i, text = queue.pop(0)
                ids = build_prompt_ids(self.tok, None, [{"role": "user", "content": text}])
                self.engine.add(EngineRequest(str(i), ids, SamplingParams(max_tokens=output, temperature=0.0),
                                              ignore_eos=True))
                live[str(i)] = [time.perf_counter(), None, None, 0]
            outs = self.engine.step()
            now = time.perf_counter()
            for o in outs:
                rec = live[o.rid]
                if o.token_ids:
                    rec[1] = rec[1] or now
                    rec[2] = now
                    rec[3] += len(o.token_ids)
                if o.finished:
                    records.append(tuple(live.pop(o.rid)))
        return records


async def ws_run(ws_url: str, texts: list[str], concurrency: int, output: int) -> tuple[list[tuple], int]:
    import websockets
    queue = list(texts)
    records, errors = [], 0

    async def client() -> None:
        nonlocal errors
        async with websockets.connect(ws_url, subprotocols=["llm-stream.json"], max_size=None) as ws:
            while queue:
                text = queue.pop(0)
                start, first, last, tokens = time.perf_counter(), None, None, 0
                await ws.send(json.dumps({"type": "generate", "id": "r", "max_tokens": output, "temperature": 0,
                                          "ignore_eos": True, "messages": [{"role": "user", "content": text}]}))
                async for frame in ws:
                    msg = json.loads(frame)
                    if msg["type"] == "chunk" and msg["tokens"]:
                        now = time.perf_counter()
                        first = first or now
                        last, tokens = now, tokens + msg["tokens"]
                    elif msg["type"] == "done":
                        if msg["finish_reason"] == "error":
                            errors += 1
                        break
                    elif msg["type"] == "error":
                        errors += 1
                        break
                if first is not None:
                    records.append((start, first, last, tokens))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return records, errors


def guidellm_run(target: str, profile: str, count: int, prompt: int, output: int, tok_dir: str,
                 work: Path, seed: int) -> dict:
    """guidellm's own run and figures; `seed` gives each run prompts no target has seen (llama.cpp
    keeps a slot's last prompt cached, as the stack's prefix cache would)."""
    streams = PROFILES[profile]
    kind = "kind=synchronous" if streams == 1 else f"kind=concurrent,streams={streams}"
    report = work / f"guidellm-{abs(hash((target, profile, time.time())))}.json"
    exe = Path(sys.executable).with_name("guidellm")
    cmd = [str(exe), "run", "--backend", f"kind=openai_http,target={target}", "--profile", kind,
           "--constraint", f"kind=max_requests,count={count}",
           "--data", f"kind=synthetic_text,prompt_tokens={prompt},output_tokens={output}",
           # guidellm's data worker prefetches 4,096 synthetic prompts by default: a core at 100%
           # for the first 6-10 s of every run, beside the target on a small box (the first
           # requests' TTFT 4x, session 23); a few ahead of demand is what a client does
           "--data-loader", f"kind=pytorch,prefetch_factor={min(count, 2 * streams)}",
           "--tokenizer", f"kind=huggingface_auto,model={tok_dir}", "--output", f"kind=json,path={report}",
           "--seed", f"kind=static,value={seed}", "--disable-console"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"guidellm failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    bench = json.loads(report.read_text())["benchmarks"][0]
    m = bench["metrics"]

    def stat(name: str, key: str) -> float:
        s = m[name]["successful"]
        return s["median"] if key == "p50" else s["percentiles"][key]
    totals = m["request_totals"]
    out_tokens = m["output_token_count"]["successful"]["total_sum"]
    return {"requests": totals["successful"], "errors": totals["errored"] + totals["incomplete"],
            "out_tokens": out_tokens, "out_tok_s": round(out_tokens / bench["duration"], 2),
            "ttft_p50_ms": round(stat("time_to_first_token_ms", "p50"), 1),
            "ttft_p95_ms": round(stat("time_to_first_token_ms", "p95"), 1),
            "itl_p50_ms": round(stat("inter_token_latency_ms", "p50"), 2),
            "itl_p95_ms": round(stat("inter_token_latency_ms", "p95"), 2)}


# ---------------------------------------------------------------- the stack

def start_stack(worker_env: dict[str, str], run_dir: Path) -> tuple[subprocess.Popen, str]:
    state = run_dir / "stack.json"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env.update(worker_env)
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "stack.py"), "--gateway-port", "0",
                             "--worker-metrics-port", "-1", "--run-dir", str(run_dir), "--state-file", str(state)],
                            env=env, stdout=open(run_dir / "stack.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the stack exited: {(run_dir / 'stack.log').read_text()[-3000:]}")
        if state.exists():
            try:
                info = json.loads(state.read_text())
                base = info["gateways"][0]["url"] if "gateways" in info else None
            except (ValueError, KeyError, IndexError):
                base = None
            if base and _ok(base.replace("ws://", "http://").split("/v1")[0] + "/health"):
                return proc, base.replace("ws://", "http://").split("/v1")[0]
        time.sleep(0.5)
    raise RuntimeError("the stack did not become ready")


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def part_of(p) -> str:
    """Which part of the stack a process is: redis, gateway, worker, engine (the worker's engine
    child) or stack (scripts/stack.py itself)."""
    cmd = " ".join(p.cmdline())
    if "redis-server" in cmd:
        return "redis"
    if "spawn_main" in cmd:               # the engine child (spawned)
        return "engine"
    if "resource_tracker" in cmd:         # multiprocessing's helper beside the worker
        return "worker"
    for part in ("gateway", "worker"):
        if f"-m {part}" in cmd or f"{part}/__main__" in cmd:
            return part
    return "stack"


def stack_cpu_by_part(proc: subprocess.Popen | None) -> dict[str, tuple[float, int]]:
    """Per part of the stack (part_of): CPU seconds so far and voluntary context switches (each
    one a sleep, so a wake-up), to see where a token's CPU goes."""
    if proc is None:
        return {}
    import psutil
    parts: dict[str, tuple[float, int]] = {}
    try:
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                part = part_of(p)
                # every thread's switches (psutil's num_ctx_switches counts the main thread only)
                wakes = sum(_voluntary_switches(p.pid, tid.id) for tid in p.threads())
                cpu, woke = parts.get(part, (0.0, 0))
                parts[part] = (cpu + t.user + t.system, woke + wakes)
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return parts


def _voluntary_switches(pid: int, tid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def client_cpu_s() -> float:
    """CPU seconds so far of this process and its finished children (guidellm's runs; the stack's
    processes count only once they have exited, after the last row)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def stop_stack(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


# ---------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default="engine,openai,ws,llamacpp")
    ap.add_argument("--profiles", default="sync,c4,c16")
    ap.add_argument("--requests", type=int, default=0, help="requests per profile (0: 6 for sync, 4x streams else)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--url", default="", help="a running gateway (http://host:port) instead of starting the stack")
    ap.add_argument("--llamacpp-url", default="", help="a running llama-server for the llamacpp target")
    ap.add_argument("--worker-env", action="append", default=[], help="K=V for the started worker (repeatable)")
    ap.add_argument("--seed", type=int, default=0, help="0: a fresh random seed (recorded in the JSON)")
    ap.add_argument("--name", default="serving")
    args = ap.parse_args()
    targets = [t for t in args.targets.split(",") if t != "llamacpp" or args.llamacpp_url]
    worker_env = dict(kv.split("=", 1) for kv in args.worker_env)

    from shared.config import Settings
    from transformers import AutoTokenizer
    from worker.engine.model_files import SMOLLM2_GGUF, smollm2_dir
    work = Path(tempfile.mkdtemp(prefix="serving-"))
    tok_dir = work / "tokenizer"
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir()), gguf_file=SMOLLM2_GGUF)
    tok.save_pretrained(tok_dir)

    stack, base = (None, args.url.rstrip("/"))
    if not base and {"openai", "ws"} & set(targets):
        stack, base = start_stack(worker_env, work)
    engine = None
    if "engine" in targets:
        settings = Settings(**{k.lower(): v for k, v in worker_env.items()})
        engine = EngineTarget(settings, max_batch=max(PROFILES[p] for p in args.profiles.split(",")))
    # prompts no target has seen, in any run (a llama.cpp server left running keeps its slots'
    # last prompts cached across runs; the stack started here has a fresh cache)
    run_seed = args.seed or random.SystemRandom().randrange(1, 1 << 30)
    rows = []
    try:
        for p_i, profile in enumerate(args.profiles.split(",")):
            streams = PROFILES[profile]
            count = args.requests or (6 if streams == 1 else 4 * streams)
            for target in targets:       # interleaved: the box's noise falls on every target alike
                seed = run_seed + p_i * 10 + len(rows)
                t0, parts0, client0 = time.perf_counter(), stack_cpu_by_part(stack), client_cpu_s()
                if target == "engine":
                    texts = prompt_texts(engine.tok, count, args.prompt_tokens, seed)
                    row = summarize("engine", profile, engine.run(texts, streams, args.output_tokens))
                elif target == "ws":
                    texts = prompt_texts(tok, count, args.prompt_tokens, seed)
                    records, errors = asyncio.run(ws_run(base.replace("http", "ws", 1) + "/v1/stream", texts,
                                                         streams, args.output_tokens))
                    row = summarize("ws", profile, records, errors)
                else:
                    url = base if target == "openai" else args.llamacpp_url.rstrip("/")
                    row = {"target": target, "profile": profile,
                           **guidellm_run(url, profile, count, args.prompt_tokens, args.output_tokens,
                                          str(tok_dir), work, seed=run_seed + len(rows))}
                wall = time.perf_counter() - t0
                row["wall_s"] = round(wall, 1)
                # where the 2 cores went: the load generator (this process, guidellm) and the stack
                parts = stack_cpu_by_part(stack)
                row["client_cores"] = round((client_cpu_s() - client0) / wall, 2)
                row["stack_cores"] = round(sum(v[0] - parts0.get(k, (0.0, 0))[0] for k, v in parts.items()) / wall, 2)
                tokens = row.get("out_tokens") or 0
                if stack is not None and target in ("openai", "ws") and tokens:
                    # ms of CPU per output token, by part (the engine's includes its torch threads)
                    row["cpu_ms_per_token"] = {k: round(1000 * (v[0] - parts0.get(k, (0.0, 0))[0]) / tokens, 2)
                                               for k, v in sorted(parts.items())}
                    row["cpu_ms_per_token"]["client"] = round(1000 * (client_cpu_s() - client0) / tokens, 2)
                    row["wakes_per_token"] = {k: round((v[1] - parts0.get(k, (0.0, 0))[1]) / tokens, 2)
                                              for k, v in sorted(parts.items())}
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        if stack is not None:
            stop_stack(stack)
    by = {(r["target"], r["profile"]): r for r in rows}
    for r in rows:
        e = by.get(("engine", r["profile"]))
        if e and e["out_tok_s"]:
            r["x_engine_tok_s"] = round(r["out_tok_s"] / e["out_tok_s"], 2)
        ll = by.get(("llamacpp", r["profile"]))
        if ll and ll["out_tok_s"]:
            r["x_llamacpp_tok_s"] = round(r["out_tok_s"] / ll["out_tok_s"], 2)
    from worker.engine.cpu_kernels import cpu_model
    from worker.engine.quantize import kernel_path
    cpu = cpu_model()
    threads = engine.threads if engine else None
    kernels = kernel_path(engine.model) if engine else None
    print(f"CPU: {cpu}, {os.cpu_count()} cores; engine torch threads: {threads}; kernels: {kernels}; "
          f"worker env: {worker_env or 'defaults'}")
    print(table(rows, ["target", "profile", "requests", "errors", "out_tok_s", "x_engine_tok_s", "x_llamacpp_tok_s",
                       "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms", "wall_s", "client_cores",
                       "stack_cores"]))
    split = [{"target": r["target"], "profile": r["profile"], **r["cpu_ms_per_token"]} for r in rows
             if "cpu_ms_per_token" in r]
    if split:
        print("CPU ms per output token, by part of the stack (engine: its torch threads too):")
        print(table(split, ["target", "profile", *sorted({k for r in split for k in r} - {"target", "profile"})]))
        wakes = [{"target": r["target"], "profile": r["profile"], **r["wakes_per_token"]} for r in rows
                 if "wakes_per_token" in r]
        print("Wake-ups (voluntary context switches, every thread) per output token, by part:")
        print(table(wakes, ["target", "profile", *sorted({k for r in wakes for k in r} - {"target", "profile"})]))
    path = write_json(args.name, {"cpu": cpu, "engine_threads": threads, "kernels": kernels, "worker_env": worker_env, "seed": run_seed,
                                  "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
                                  "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
