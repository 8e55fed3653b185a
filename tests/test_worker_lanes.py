"""Priority lanes end to end through a real worker process: the worker takes WORKER_QUEUE_DEPTH
requests beyond its running batch, so the engine (not the Redis stream's FIFO) decides what is
admitted next: an interactive request sent behind a flood of batch requests goes first."""

from __future__ import annotations

import time

from shared.sampling import SamplingParams
from shared.streams import ENTRY_FIELD, Keys, RequestEntry
from tests.stack_fixtures import start_worker
from tests.worker_redis import check_seqs, new_rid, read_events


async def test_interactive_request_overtakes_queued_batch_work(redis_server, redis_client, stream_prefix,
                                                               tiny_model_dir, tmp_path):
    keys = Keys(stream_prefix)
    proc = start_worker(redis_server.url, stream_prefix, tiny_model_dir, tmp_path, name="w-lanes",
                        env={"MAX_BATCH": 2, "WORKER_QUEUE_DEPTH": 16, "MAX_SEQ_LEN": 1024})
    try:
        def entry(priority: str, max_tokens: int) -> RequestEntry:
            return RequestEntry(rid=new_rid(), params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                prompt="Tell me a story about a cat.", priority=priority,
                                created_ms=int(time.time() * 1000))
        batch = [entry("batch", 48) for _ in range(10)]
        urgent = entry("interactive", 4)
        async with redis_client.pipeline(transaction=True) as pipe:   # all queued at once, batch first
            for e in batch + [urgent]:
                pipe.xadd(keys.requests, {ENTRY_FIELD: e.encode()})
            await pipe.execute()
        first_ms = {}
        for e in [urgent] + batch:
            events = await read_events(redis_client, keys, e.rid, timeout=120)
            check_seqs(events)
            assert events[-1]["k"] == "done"
            first_ms[e.rid] = events[0]["ms"]
        overtaken = sum(1 for e in batch if first_ms[e.rid] > first_ms[urgent.rid])
        # two batch requests hold the slots when it arrives; every other one is queued behind it
        assert overtaken >= 7, sorted((ms - first_ms[urgent.rid]) for ms in first_ms.values())
    finally:
        proc.stop()
