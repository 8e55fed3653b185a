"""Per-token flushing vs chunked flushing in the gateway, at 1, 32 and 256 concurrent streams.

One run starts its own Redis and one real worker (tiny random model by default: it decodes
fast, so the gateway is the bottleneck), then for each (concurrency, FLUSH_INTERVAL_MS) runs a
fresh `python -m gateway` subprocess and N concurrent WebSocket streams against it.

Two token sources, both over the real Redis contract (`{p}:requests` -> `{p}:out:{rid}`):
* `worker`: a real `python -m worker` (tiny model). On a small CPU box the model, not the
  gateway, sets the pace, so chunking has little to merge at high concurrency;
* `synthetic`: a decode-loop stand-in (`--produce`, its own process) that emits one token per
  stream every `--step-ms` (default 20 ms = 50 tokens/s per stream, a GPU-like pace) in one
  pipelined XADD batch per step, like a batched worker. It makes the gateway the bottleneck,
  which is what the flush policy is about.

Reported per cell: chunk frames/s, gateway CPU (user+sys of the gateway process) per output
token, and the client-observed gap between consecutive chunks of a stream (p50/p95). The
baseline is per-token flushing (0 ms) measured in the same run; `cpu_ratio` and
`frames_ratio` are chunked / per-token.

    .venv/bin/python bench/flush.py                 # tiny model, intervals 0 and 40 ms
    .venv/bin/python bench/flush.py --quick         # fewer tokens (smoke run)
    .venv/bin/python bench/flush.py --source worker # only the real worker
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import websockets  # noqa: E402

from bench.common import percentile, table, write_json  # noqa: E402
from shared.localredis import LocalRedis  # noqa: E402
from tests.stack_fixtures import start_gateway, start_worker  # noqa: E402


async def one_stream(url: str, idx: int, max_tokens: int, out: dict) -> None:
    async with websockets.connect(url, subprotocols=["llm-stream.json"], max_size=None,
                                  ping_interval=None, open_timeout=60) as ws:
        await ws.send(json.dumps({"type": "generate", "id": f"b{idx}", "prompt": f"Bench stream {idx}:",
                                  "max_tokens": max_tokens, "temperature": 1.0, "seed": idx}))
        arrivals, tokens, frames = [], 0, 0
        while True:
            msg = json.loads(await asyncio.wait_for(ws.recv(), 120))
            kind = msg["type"]
            if kind == "chunk":
                arrivals.append(time.monotonic())
                tokens += msg["tokens"]
                frames += 1
            elif kind == "done":
                break
            elif kind == "error":
                raise RuntimeError(f"stream {idx} refused: {msg}")
        out["gaps"].extend(b - a for a, b in zip(arrivals, arrivals[1:]))
        out["tokens"] += tokens
        out["frames"] += frames


async def run_cell(base: str, pid: int, streams: int, max_tokens: int) -> dict:
    url = base.replace("http", "ws") + "/v1/stream"
    proc = psutil.Process(pid)
    out = {"gaps": [], "tokens": 0, "frames": 0}
    cpu0 = proc.cpu_times()
    t0 = time.monotonic()
    await asyncio.gather(*(one_stream(url, i, max_tokens, out) for i in range(streams)))
    wall = time.monotonic() - t0
    cpu1 = proc.cpu_times()
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return {
        "streams": streams, "tokens": out["tokens"], "frames": out["frames"], "wall_s": wall,
        "frames_per_s": out["frames"] / wall, "tokens_per_s": out["tokens"] / wall,
        "gw_cpu_s": cpu, "gw_cpu_us_per_token": cpu / max(1, out["tokens"]) * 1e6,
        "tokens_per_frame": out["tokens"] / max(1, out["frames"]),
        "gap_p50_ms": percentile(out["gaps"], 50) * 1000, "gap_p95_ms": percentile(out["gaps"], 95) * 1000,
    }


def run_gateway_cell(redis_url: str, prefix: str, work: Path, streams: int, interval: int, max_tokens: int) -> dict:
    gw, base = start_gateway(redis_url, prefix, work, name=f"gw-{prefix}-{streams}-{interval}", env={
        "FLUSH_INTERVAL_MS": interval, "FLUSH_MAX_TOKENS": 24, "HEARTBEAT_S": 0,
        "PER_KEY_CONCURRENCY": 0, "PER_KEY_RATE_PER_MIN": 0, "MAX_QUEUE_DEPTH": 100000})
    try:
        asyncio.run(run_cell(base, gw.pid, min(streams, 4), 8))        # warm-up
        row = asyncio.run(run_cell(base, gw.pid, streams, max_tokens))
    finally:
        gw.stop()
    row["flush_ms"] = interval
    return row


# ---------------------------------------------------------------- synthetic token source

async def produce(redis_url: str, prefix: str, step_ms: float) -> None:
    """Play the worker side of the Redis contract at a fixed decode pace (see module doc)."""
    import redis.asyncio as aioredis

    from shared.streams import CONSUMER_GROUP, ENTRY_FIELD, Keys, RequestEntry, encode_event

    keys = Keys(prefix)
    r = aioredis.from_url(redis_url)
    try:
        await r.xgroup_create(keys.requests, CONSUMER_GROUP, id="0", mkstream=True)
    except Exception:
        pass
    active: dict[str, list] = {}      # rid -> [entry_id, max_tokens, seq]
    words = ["lorem ", "ipsum ", "dolor ", "sit ", "amet, ", "consectetur ", "adipiscing ", "elit. "]
    last_beat = 0.0
    next_step = time.monotonic()
    while True:
        now = time.monotonic()
        if now - last_beat > 1.0:
            await r.zadd(keys.workers, {"synthetic": int(time.time() * 1000)})
            last_beat = now
        block = max(1, int((next_step - now) * 1000)) if not active else None
        resp = await r.xreadgroup(CONSUMER_GROUP, "synthetic", {keys.requests: ">"}, count=1024, block=block)
        for _key, entries in resp or []:
            for entry_id, fields in entries:
                entry = RequestEntry.decode(fields[ENTRY_FIELD])
                active[entry.rid] = [entry_id, entry.params.max_tokens, 0]
        now = time.monotonic()
        if now < next_step:
            await asyncio.sleep(next_step - now)
        next_step = max(next_step + step_ms / 1000, time.monotonic())
        if not active:
            continue
        async with r.pipeline(transaction=False) as pipe:
            for rid, st in list(active.items()):
                st[2] += 1
                out = keys.out(rid)
                pipe.xadd(out, {ENTRY_FIELD: encode_event("tok", st[2], text=words[st[2] % 8], n=1, t=st[2])})
                if st[2] >= st[1]:
                    pipe.xadd(out, {ENTRY_FIELD: encode_event("done", st[2], finish_reason="length",
                                                              usage={"prompt_tokens": 4, "completion_tokens": st[2]})})
                    pipe.expire(out, 600)
                    pipe.xack(keys.requests, CONSUMER_GROUP, st[0])
                    del active[rid]
            await pipe.execute()


def start_source(kind: str, redis_url: str, prefix: str, work: Path, args, max_streams: int):
    if kind == "worker":
        model = args.model
        if not model:
            from tests.tiny_model import make_tiny_model_dir
            model = str(make_tiny_model_dir(work / "tiny-model"))
        return start_worker(redis_url, prefix, model, work, name="bench-worker",
                            env={"MAX_BATCH": str(max_streams), "TORCH_THREADS": "1"})
    import subprocess
    log = open(work / "synthetic.log", "ab")
    popen = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--produce", "--redis", redis_url,
                              "--prefix", prefix, "--step-ms", str(args.step_ms)],
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    from tests.stack_fixtures import Proc, wait_for_worker
    proc = Proc(popen, work / "synthetic.log")
    wait_for_worker(redis_url, prefix, proc, timeout=30)
    return proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,32,256")
    ap.add_argument("--intervals", default="0,40", help="FLUSH_INTERVAL_MS values; the first is the baseline")
    ap.add_argument("--tokens", type=int, default=0, help="max_tokens per stream (0 = by concurrency)")
    ap.add_argument("--model", default="", help="MODEL_PATH for the worker (default: tiny random model)")
    ap.add_argument("--source", default="synthetic,worker", help="token sources to run: synthetic, worker")
    ap.add_argument("--step-ms", type=float, default=20.0, help="synthetic source: ms per decode step")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--produce", action="store_true", help=argparse.SUPPRESS)   # internal: run the source
    ap.add_argument("--redis", help=argparse.SUPPRESS)
    ap.add_argument("--prefix", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.produce:
        asyncio.run(produce(args.redis, args.prefix, args.step_ms))
        return
    streams_list = [int(s) for s in args.streams.split(",")]
    intervals = [int(s) for s in args.intervals.split(",")]

    work = Path(tempfile.mkdtemp(prefix="bench-flush-"))
    redis_server = LocalRedis().start()
    rows = []
    try:
        for source in args.source.split(","):
            prefix = f"bf{uuid.uuid4().hex[:6]}"
            producer = start_source(source, redis_server.url, prefix, work, args, max(streams_list))
            try:
                for streams in streams_list:
                    max_tokens = args.tokens or {1: 400, 32: 200}.get(streams, 100)
                    if args.quick:
                        max_tokens = max(8, max_tokens // 4)
                    baseline = None
                    for interval in intervals:
                        row = run_gateway_cell(redis_server.url, prefix, work, streams, interval, max_tokens)
                        row["source"] = source
                        if baseline is None:
                            baseline = row
                        row["cpu_ratio"] = row["gw_cpu_us_per_token"] / baseline["gw_cpu_us_per_token"]
                        row["frames_ratio"] = row["frames_per_s"] / baseline["frames_per_s"]
                        rows.append(row)
                        print(f"{source:9} streams={streams:<4} flush={interval:>3}ms  "
                              f"frames/s={row['frames_per_s']:8.0f}  cpu/token={row['gw_cpu_us_per_token']:7.1f}us  "
                              f"gap p50/p95={row['gap_p50_ms']:.1f}/{row['gap_p95_ms']:.1f}ms", flush=True)
            finally:
                producer.stop()
    finally:
        redis_server.stop()

    columns = ["source", "streams", "flush_ms", "tokens", "frames", "tokens_per_frame", "frames_per_s", "tokens_per_s",
               "gw_cpu_us_per_token", "cpu_ratio", "frames_ratio", "gap_p50_ms", "gap_p95_ms"]
    print()
    print(table(rows, columns))
    path = write_json("flush", {"baseline": f"FLUSH_INTERVAL_MS={intervals[0]}", "model": args.model or "tiny",
                                "synthetic_step_ms": args.step_ms, "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
