"""Priority lanes end to end: a flood of long `batch` requests plus a trickle of `interactive`
ones against one real worker (tiny model, CPU), in three configurations measured in one run:

* lanes:          priorities as sent, WORKER_QUEUE_DEPTH=32 (the worker queues work in its
                  engine, whose admission and prefill go interactive first, batch aged);
* all-interactive: the same load with every request sent as interactive (FIFO: the baseline);
* lanes, depth 0: priorities as sent, but the worker reads only what it can run at once (the
                  intake before issue 11: the engine queue is almost always empty).

Reports interactive TTFT p50/p95 (entry written -> first token in history, both on this box's
clock) and batch throughput (batch tokens / time until the last batch request finished).

    .venv/bin/python bench/lanes.py [--batch 24 --batch-tokens 96 --interactive-every 0.4]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis.asyncio as aioredis  # noqa: E402

from bench.common import percentile, table, write_json  # noqa: E402
from shared.localredis import LocalRedis  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402
from shared.streams import ENTRY_FIELD, Keys, RequestEntry, decode_event  # noqa: E402
from tests.stack_fixtures import start_worker  # noqa: E402
from tests.tiny_model import make_tiny_model_dir  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and the sea. " * 3


async def first_and_last(redis, keys: Keys, rid: str, timeout: float) -> tuple[int, int, int]:
    """(ms of the first token event, ms of the final event, tokens) from rid's history."""
    last, first_ms, deadline = "0-0", 0, time.monotonic() + timeout
    while time.monotonic() < deadline:
        resp = await redis.xread({keys.out(rid): last}, block=500, count=500)
        for _k, entries in resp or []:
            for entry_id, fields in entries:
                last = entry_id.decode()
                ev = decode_event(fields[ENTRY_FIELD])
                if ev["k"] == "tok" and not first_ms:
                    first_ms = ev["ms"]
                if ev["k"] in ("done", "err"):
                    return first_ms, ev["ms"], ev["seq"]
    raise RuntimeError(f"{rid} did not finish within {timeout}s")


async def run_config(url: str, prefix: str, name: str, lanes: bool, args) -> dict:
    keys = Keys(prefix)
    redis = aioredis.from_url(url)
    n = 0

    async def submit(priority: str, max_tokens: int) -> tuple[str, int]:
        nonlocal n
        n += 1
        rid = f"{name}-{n}-{time.time_ns()}"
        created = int(time.time() * 1000)
        entry = RequestEntry(rid=rid, params=SamplingParams(max_tokens=max_tokens, temperature=0.0), prompt=PROMPT,
                             priority=priority if lanes else "interactive", created_ms=created)
        await redis.xadd(keys.requests, {ENTRY_FIELD: entry.encode()})
        return rid, created

    t0 = time.time() * 1000
    batch = [await submit("batch", args.batch_tokens) for _ in range(args.batch)]
    interactive = []
    end = time.monotonic() + args.duration
    while time.monotonic() < end:
        interactive.append(await submit("interactive", args.interactive_tokens))
        await asyncio.sleep(args.interactive_every)
    ttft = []
    for rid, created in interactive:
        first, _, _ = await first_and_last(redis, keys, rid, 600)
        ttft.append(first - created)
    done_ms, tokens = 0, 0
    for rid, _ in batch:
        _, last, seq = await first_and_last(redis, keys, rid, 900)
        done_ms, tokens = max(done_ms, last), tokens + seq
    await redis.aclose()
    return {"config": name, "interactive": len(ttft), "ttft_p50_ms": percentile(ttft, 50),
            "ttft_p95_ms": percentile(ttft, 95), "batch_tok_s": tokens / ((done_ms - t0) / 1000),
            "batch_done_s": (done_ms - t0) / 1000}


async def main_async(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-lanes-"))
    model = make_tiny_model_dir(work / "tiny")
    server = LocalRedis().start()
    rows = []
    try:
        for name, lanes, depth in (("lanes", True, 32), ("all-interactive", False, 32), ("lanes, depth 0", True, 0)):
            prefix = f"lanes{len(rows)}"
            proc = start_worker(server.url, prefix, model, work, name=f"w{len(rows)}",
                                env={"MAX_BATCH": args.max_batch, "WORKER_QUEUE_DEPTH": depth, "MAX_SEQ_LEN": 1024,
                                     "PREFILL_CHUNK": 64, "TORCH_THREADS": 1})
            try:
                rows.append(await run_config(server.url, prefix, name, lanes, args))
            finally:
                proc.stop()
            print(rows[-1], flush=True)
    finally:
        server.stop()
    base = next(r for r in rows if r["config"] == "all-interactive")
    for r in rows:
        r["ttft_p95_vs_fifo"] = r["ttft_p95_ms"] / base["ttft_p95_ms"]
        r["batch_tok_s_vs_fifo"] = r["batch_tok_s"] / base["batch_tok_s"]
    print(table(rows, ["config", "interactive", "ttft_p50_ms", "ttft_p95_ms", "ttft_p95_vs_fifo", "batch_tok_s",
                       "batch_tok_s_vs_fifo", "batch_done_s"]))
    print("written to", write_json("lanes", {"args": vars(args), "rows": rows}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--batch", type=int, default=24, help="batch requests, all sent at the start")
    ap.add_argument("--batch-tokens", type=int, default=96)
    ap.add_argument("--interactive-tokens", type=int, default=8)
    ap.add_argument("--interactive-every", type=float, default=0.4, help="seconds between interactive requests")
    ap.add_argument("--duration", type=float, default=12.0, help="seconds the interactive trickle lasts")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
