"""Interactive TTFT while a Batch API batch runs (issue 35 item 5): one real worker (tiny model,
CPU) and one gateway, in one run, three configurations:

* alone:                 a trickle of streamed interactive chat requests, nothing else;
* beside a batch:        the same trickle while a 500-request batch (`/v1/files` +
                         `/v1/batches`, the batch lane, BATCH_CONCURRENCY in flight) runs;
* beside interactive:    the same trickle beside the same 500 requests sent as ordinary
                         interactive requests at the same concurrency (what the lane saves).

Reports interactive TTFT p50/p95 (the client's clock: request sent -> first chunk; a stream's
headers wait for its first token) and how many background requests finished meanwhile.

    .venv/bin/python bench/batch_lane.py [--batch 500 --batch-tokens 32 --interactive 40]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from openai import AsyncOpenAI  # noqa: E402

from bench.common import percentile, table, write_json  # noqa: E402
from shared.localredis import LocalRedis  # noqa: E402
from tests.stack_fixtures import gateway_in_process, gateway_settings, start_worker  # noqa: E402
from tests.tiny_model import make_tiny_model_dir  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def body(i: int, tokens: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Write report {i} about the sea."}],
            "max_tokens": tokens, "temperature": 0}


EOS = {"ignore_eos": True}       # every answer runs to max_tokens (vLLM's extension; `extra_body` in the SDK)


async def trickle(oai: AsyncOpenAI, args) -> list[float]:
    """TTFT (ms) of `args.interactive` streamed chats, one every `args.every` seconds."""
    async def one(i: int) -> float:
        start = time.perf_counter()
        stream = await oai.chat.completions.create(**body(10_000 + i, args.interactive_tokens), stream=True,
                                                   extra_body=EOS)
        first = None
        async for _ in stream:
            first = first or time.perf_counter()
        return (first - start) * 1000
    tasks = []
    for i in range(args.interactive):
        tasks.append(asyncio.ensure_future(one(i)))
        await asyncio.sleep(args.every)
    return list(await asyncio.gather(*tasks))


async def beside_batch(oai: AsyncOpenAI, args) -> tuple[list[float], int, float]:
    data = "".join(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {**body(i, args.batch_tokens), **EOS}}) + "\n" for i in range(args.batch)).encode()
    upload = await oai.files.create(file=("bench.jsonl", io.BytesIO(data)), purpose="batch")
    t0 = time.perf_counter()
    batch = await oai.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    while (await oai.batches.retrieve(batch.id)).request_counts.completed < args.concurrency:
        await asyncio.sleep(0.2)                       # the batch is running at full concurrency
    ttft = await trickle(oai, args)
    during = (await oai.batches.retrieve(batch.id)).request_counts.completed
    while (b := await oai.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
        await asyncio.sleep(0.5)
    assert b.status == "completed" and b.request_counts.completed == args.batch, b
    return ttft, during, time.perf_counter() - t0


async def beside_interactive(oai: AsyncOpenAI, args) -> tuple[list[float], int, float]:
    sem = asyncio.Semaphore(args.concurrency)
    finished = 0

    async def one(i: int) -> None:
        nonlocal finished
        async with sem:
            await oai.chat.completions.create(**body(i, args.batch_tokens), extra_body=EOS)
            finished += 1
    t0 = time.perf_counter()
    background = asyncio.gather(*(one(i) for i in range(args.batch)))
    while finished < args.concurrency:
        await asyncio.sleep(0.2)
    ttft = await trickle(oai, args)
    during = finished
    await background
    return ttft, during, time.perf_counter() - t0


async def main_async(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-batch-lane-"))
    model = make_tiny_model_dir(work / "tiny")
    server = LocalRedis().start()
    rows = []
    proc = start_worker(server.url, "bl", model, work, name="w-bl",
                        env={"MAX_BATCH": args.max_batch, "WORKER_QUEUE_DEPTH": 32, "MAX_SEQ_LEN": 1024,
                             "PREFILL_CHUNK": 64, "TORCH_THREADS": 1})
    try:
        settings = gateway_settings(server.url, "bl", batch_concurrency=args.concurrency, per_key_concurrency=64,
                                    per_key_rate_per_min=100_000)
        async with gateway_in_process(settings) as gw:
            oai = AsyncOpenAI(base_url=gw.base + "/v1", api_key="none", max_retries=0, timeout=600)
            await trickle(oai, argparse.Namespace(**{**vars(args), "interactive": 3}))      # warm up
            for name, run in (("alone", None), ("beside a batch", beside_batch),
                              ("beside interactive", beside_interactive)):
                if run is None:
                    ttft, during, took = await trickle(oai, args), 0, 0.0
                else:
                    ttft, during, took = await run(oai, args)
                rows.append({"config": name, "interactive": len(ttft), "ttft_p50_ms": percentile(ttft, 50),
                             "ttft_p95_ms": percentile(ttft, 95), "background_done_meanwhile": during,
                             "background_total_s": took})
                print(rows[-1], flush=True)
    finally:
        proc.stop()
        server.stop()
    print(table(rows, ["config", "interactive", "ttft_p50_ms", "ttft_p95_ms", "background_done_meanwhile",
                       "background_total_s"]))
    print("written to", write_json("batch_lane", {"args": vars(args), "rows": rows}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--batch", type=int, default=500, help="requests in the batch")
    ap.add_argument("--batch-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8, help="BATCH_CONCURRENCY (and the interactive flood's)")
    ap.add_argument("--interactive", type=int, default=40, help="interactive requests measured per configuration")
    ap.add_argument("--interactive-tokens", type=int, default=8)
    ap.add_argument("--every", type=float, default=0.25, help="seconds between interactive requests")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
