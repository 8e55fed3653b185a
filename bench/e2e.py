"""End-to-end serving benchmark over real WebSockets, like vLLM's `benchmark_serving.py`.

One run starts its own Redis, `--workers` x `python -m worker` and `--gateways` x
`python -m gateway` (or uses `--url` of a running stack), then sends `--requests` chat requests,
each on its own socket (as browsers do), either open-loop with Poisson arrivals at `--rate`
requests/s or at fixed `--concurrency`. Reported per request: TTFT (send -> first chunk),
the gap between consecutive chunks, end-to-end latency; overall: request throughput and
output tokens/s. Then a few requests are cancelled mid-stream to measure cancel -> final
`done` latency through the whole path.

Baseline in the same run: the same prompts with the same arrival schedule fed straight into an
in-process `Engine` (same model, same batch size, same torch threads, no Redis, no sockets),
after the stack is stopped so both get the same CPU. `ratio` = stack / in-process. Note the
gateway chunks tokens (FLUSH_INTERVAL_MS), so the stack's "gap" is between chunks while the
baseline's is between tokens.

    .venv/bin/python bench/e2e.py                           # SmolLM2, 32 requests at 1 req/s
    .venv/bin/python bench/e2e.py --tiny --rate 8 --requests 200
    .venv/bin/python bench/e2e.py --concurrency 8 --requests 64
    .venv/bin/python bench/e2e.py --url ws://host/v1/stream # an existing stack (no baseline)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import websockets  # noqa: E402

from bench.common import percentile, table, write_json  # noqa: E402

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for learning a new language.",
    "What is the capital of France, and why is it famous?",
    "Describe a sunset to someone who has never seen one.",
    "Summarize the plot of a detective story you invent.",
    "List five fruits and one fact about each.",
    "How does a bicycle stay upright?",
]


@dataclass
class Result:
    sent: float = 0.0
    first: float | None = None
    end: float | None = None
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0
    finish: str = ""
    ok: bool = False


def messages_for(i: int) -> list[dict]:
    return [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Poisson process: exponential inter-arrival times (rate <= 0: all at t=0)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        if rate > 0:
            t += rng.expovariate(rate)
    return out


# ---- the stack over WebSockets ---------------------------------------------------------------

async def ws_request(url: str, i: int, max_tokens: int, cancel_after: int | None = None) -> Result:
    r = Result()
    async with websockets.connect(url, subprotocols=["llm-stream.json"], max_size=None) as ws:
        r.sent = time.perf_counter()
        await ws.send(json.dumps({"type": "generate", "id": "q", "messages": messages_for(i),
                                  "max_tokens": max_tokens, "temperature": 0.0}))
        cancel_sent = None
        async for raw in ws:
            msg = json.loads(raw)
            now = time.perf_counter()
            if msg["type"] == "chunk":
                r.first = r.first or now
                r.chunks.append(now)
                r.tokens += msg["tokens"]
                if cancel_after is not None and cancel_sent is None and r.tokens >= cancel_after:
                    cancel_sent = time.perf_counter()
                    await ws.send(json.dumps({"type": "cancel", "id": "q"}))
            elif msg["type"] == "done":
                r.end, r.finish, r.ok = now, msg["finish_reason"], True
                if cancel_sent is not None:
                    r.sent = cancel_sent  # for cancel probes: `end - sent` is cancel -> done
                return r
            elif msg["type"] == "error":
                r.end, r.finish = now, msg["code"]
                return r
    return r


async def run_load(url: str, n: int, rate: float, concurrency: int, max_tokens: int, seed: int) -> tuple[list[Result], float]:
    start = time.perf_counter()
    if concurrency > 0:
        queue = list(range(n))
        results: list[Result] = []

        async def client():
            while queue:
                results.append(await ws_request(url, queue.pop(0), max_tokens))
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return results, time.perf_counter() - start

    async def at(t: float, i: int) -> Result:
        await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
        return await ws_request(url, i, max_tokens)
    results = await asyncio.gather(*(at(t, i) for i, t in enumerate(arrivals(n, rate, seed))))
    return list(results), time.perf_counter() - start


# ---- in-process baseline ---------------------------------------------------------------------

def run_in_process(settings, n: int, rate: float, concurrency: int, max_tokens: int, seed: int) -> tuple[list[Result], float]:
    """The same requests and arrival schedule, straight into an Engine in this process."""
    from shared.sampling import SamplingParams
    from worker.engine import Engine, EngineConfig, EngineRequest, build_prompt_ids, load_model

    model, tokenizer = load_model(settings)
    engine = Engine(model, tokenizer, EngineConfig.from_settings(settings))
    ids = [build_prompt_ids(tokenizer, None, messages_for(i)) for i in range(n)]
    engine.add(EngineRequest(rid="warmup", prompt_ids=ids[0], params=SamplingParams(max_tokens=2, temperature=0.0)))
    while engine.has_work:
        engine.step()
    times = arrivals(n, rate, seed) if concurrency <= 0 else None
    results = [Result() for _ in range(n)]
    next_i, active = 0, 0
    start = time.perf_counter()
    while next_i < n or engine.has_work:
        now = time.perf_counter()
        while next_i < n and ((times is not None and start + times[next_i] <= now)
                              or (times is None and active < concurrency)):
            results[next_i].sent = time.perf_counter()
            engine.add(EngineRequest(rid=str(next_i), prompt_ids=ids[next_i],
                                     params=SamplingParams(max_tokens=max_tokens, temperature=0.0)))
            next_i += 1
            active += 1
        if not engine.has_work:
            time.sleep(max(0.0, min(0.01, start + times[next_i] - time.perf_counter())) if times else 0.001)
            continue
        for out in engine.step():
            r = results[int(out.rid)]
            now = time.perf_counter()
            if out.token_ids:
                r.first = r.first or now
                r.chunks.append(now)
                r.tokens += len(out.token_ids)
            if out.finished:
                r.end, r.finish, r.ok = now, out.finish_reason or "", True
                active -= 1
    return results, time.perf_counter() - start


# ---- reporting -------------------------------------------------------------------------------

def summarize(name: str, results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok and r.first is not None]
    ttft = [(r.first - r.sent) * 1000 for r in ok]
    e2e = [(r.end - r.sent) * 1000 for r in ok]
    gaps = [(b - a) * 1000 for r in ok for a, b in zip(r.chunks, r.chunks[1:])]
    tokens = sum(r.tokens for r in ok)
    row = {"path": name, "ok": len(ok), "failed": len(results) - len(ok), "req/s": len(ok) / duration,
           "out tok/s": tokens / duration}
    for label, values in (("ttft", ttft), ("gap", gaps), ("e2e", e2e)):
        for p in (50, 95, 99):
            row[f"{label} p{p} ms"] = percentile(values, p)
    return row


COLUMNS = ["path", "ok", "failed", "req/s", "out tok/s", "ttft p50 ms", "ttft p95 ms", "ttft p99 ms",
           "gap p50 ms", "gap p95 ms", "gap p99 ms", "e2e p50 ms", "e2e p95 ms", "e2e p99 ms"]


async def cancel_probes(url: str, count: int, max_tokens: int) -> list[float]:
    """Cancel -> final `done` latency (ms) of requests cancelled after 8 tokens."""
    latencies = []
    for i in range(count):
        r = await ws_request(url, i, max_tokens, cancel_after=8)
        if r.ok and r.finish == "cancelled":
            latencies.append((r.end - r.sent) * 1000)
    return latencies


def start_stack(args, log_dir: Path):
    from shared.localredis import LocalRedis
    from tests.stack_fixtures import _env, spawn, start_gateway, wait_for_worker
    from tests.tiny_model import make_tiny_model_dir

    redis = LocalRedis(appendonly=True).start()
    prefix = f"bench{uuid.uuid4().hex[:6]}"
    model = str(make_tiny_model_dir(log_dir / "tiny")) if args.tiny else ""
    worker_env = {"MODEL_PATH": model, "MAX_BATCH": args.max_batch, "MAX_SEQ_LEN": 1024,
                  "TORCH_THREADS": args.threads, "DEVICE": "cpu"}
    workers = [spawn("worker", _env(redis.url, prefix, {**worker_env, "WORKER_ID": f"bw{i}"}), log_dir, f"bw{i}")
               for i in range(args.workers)]
    for w in workers:
        wait_for_worker(redis.url, prefix, w, count=args.workers, timeout=300)
    gateways = [start_gateway(redis.url, prefix, log_dir, name=f"bg{i}",
                              env={"PER_KEY_CONCURRENCY": 10000, "PER_KEY_RATE_PER_MIN": 1000000,
                                   "MAX_QUEUE_DEPTH": 100000})
                for i in range(args.gateways)]
    urls = [base.replace("http", "ws") + "/v1/stream" for _, base in gateways]
    procs = [p for p, _ in gateways] + workers

    def stop():
        for p in procs:
            p.stop()
        redis.stop()
    return urls, stop, model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="ws URL of a running stack (no baseline then)")
    ap.add_argument("--tiny", action="store_true", help="tiny random model instead of SmolLM2")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate, requests/s (0 = all at once)")
    ap.add_argument("--concurrency", type=int, default=0, help="fixed concurrency instead of Poisson arrivals")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (2 on a busy 2-core box oversubscribes OpenMP)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--gateways", type=int, default=1)
    ap.add_argument("--cancels", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="e2e")
    args = ap.parse_args()

    rows, extra = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.url:
            urls, stop, model = [args.url], (lambda: None), "external"
        else:
            urls, stop, model = start_stack(args, Path(tmp))
        try:
            async def drive():
                # warm-up request, then the load spread over the gateways round-robin
                await ws_request(urls[0], 0, 4)
                if len(urls) == 1:
                    return await run_load(urls[0], args.requests, args.rate, args.concurrency, args.max_tokens,
                                          args.seed)
                parts = await asyncio.gather(*(run_load(u, args.requests // len(urls), args.rate / len(urls),
                                                        args.concurrency // len(urls), args.max_tokens,
                                                        args.seed + k) for k, u in enumerate(urls)))
                return [r for rs, _ in parts for r in rs], max(d for _, d in parts)
            results, duration = asyncio.run(drive())
            rows.append(summarize(f"gateway+redis ({args.gateways}g/{args.workers}w)", results, duration))
            cancels = asyncio.run(cancel_probes(urls[0], args.cancels, max(args.max_tokens, 256)))
            extra["cancel_to_done_ms"] = {"n": len(cancels), "p50": percentile(cancels, 50),
                                          "p95": percentile(cancels, 95), "max": max(cancels, default=float("nan"))}
        finally:
            stop()
        if not args.url and args.workers == 1:
            from shared.config import Settings
            settings = Settings(model_path=model, max_batch=args.max_batch, max_seq_len=1024,
                                torch_threads=args.threads, device="cpu")
            base_results, base_duration = run_in_process(settings, args.requests, args.rate, args.concurrency,
                                                         args.max_tokens, args.seed)
            base = summarize("in-process engine", base_results, base_duration)
            rows.insert(0, base)
            stack = rows[1]
            ratio = {"path": "ratio stack/in-process"}
            for c in COLUMNS[3:]:
                ratio[c] = stack[c] / base[c] if base[c] else float("nan")
            rows.append(ratio)
    print(f"\n{args.requests} requests, max_tokens {args.max_tokens}, "
          + (f"concurrency {args.concurrency}" if args.concurrency else f"Poisson {args.rate} req/s")
          + f", model {'tiny' if args.tiny else 'SmolLM2-135M-Instruct'}, max_batch {args.max_batch}, "
          f"torch threads {args.threads}\n")
    print(table(rows, COLUMNS))
    if "cancel_to_done_ms" in extra:
        c = extra["cancel_to_done_ms"]
        print(f"\ncancel -> done through gateway+redis+worker: n={c['n']} p50 {c['p50']:.1f} ms, "
              f"p95 {c['p95']:.1f} ms, max {c['max']:.1f} ms")
    path = write_json(args.name, {"args": vars(args), "rows": rows, **extra})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
