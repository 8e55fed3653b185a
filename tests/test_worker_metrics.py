"""The worker's /metrics (docs/operations.md, "Metrics"): a real worker (its engine in a child
process, a tiny model) serves requests and a cancel; its metrics, scraped over HTTP behind
ADMIN_TOKEN, show the engine's steps, tokens, latencies, KV and prefix-cache use, the cancel's
latency and the output commits."""

from __future__ import annotations

import asyncio
import time

import httpx

from shared.localredis import free_port
from shared.streams import ENTRY_FIELD, Keys, encode_cancel
from tests.gateway_client import eventually
from tests.stack_fixtures import metric, metric_samples, start_worker
from tests.worker_redis import owner_of, read_events, submit, wait_for_tokens
from worker.metrics import WorkerMetrics

TOKEN = "metrics-secret"


async def test_a_worker_reports_its_engine_requests_cancels_and_io(redis_server, redis_client, stream_prefix,
                                                                   tiny_model_dir, tmp_path):
    port = free_port()
    keys = Keys(stream_prefix)
    proc = start_worker(redis_server.url, stream_prefix, tiny_model_dir, tmp_path, name="w-metrics",
                        env={"WORKER_METRICS_PORT": port, "ADMIN_TOKEN": TOKEN, "MAX_BATCH": 8})
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            assert (await http.get(url)).status_code == 401
            auth = {"Authorization": f"Bearer {TOKEN}"}
            prompt = "Once upon a time there was a cat who lived in a small house by the sea."
            rids = [await submit(redis_client, keys, prompt=prompt, max_tokens=16) for _ in range(3)]
            long = await submit(redis_client, keys, prompt=prompt, max_tokens=1500)
            finals = []
            for rid in rids:
                finals.append((await read_events(redis_client, keys, rid))[-1])
                assert finals[-1]["finish_reason"] == "length"
            await wait_for_tokens(redis_client, keys, long, 5)
            owner = await owner_of(redis_client, keys, long)
            cancel_sent = time.time()
            await redis_client.xadd(keys.ctl(owner), {ENTRY_FIELD: encode_cancel(long)})
            finals.append((await read_events(redis_client, keys, long))[-1])
            cancel_seen = time.time()          # its blocks were freed before its final was written
            assert finals[-1]["finish_reason"] == "cancelled"
            # what the counters must report: the requests' own usage, as their finals give it
            generated = sum(f["usage"]["completion_tokens"] for f in finals)
            cached = sum(f["usage"].get("cached_tokens", 0) for f in finals)
            prefilled = sum(f["usage"]["prompt_tokens"] for f in finals) - cached

            found: dict = {}

            async def settled() -> bool:       # the engine's figures reach the metrics a few times a second
                nonlocal found
                found = metric_samples((await http.get(url, headers=auth)).text)
                return metric(found, "worker_cancel_latency_seconds_count") == 1 and \
                    metric(found, "worker_e2e_request_latency_seconds_count") >= 4 and \
                    metric(found, "worker_generation_tokens_total") == generated and \
                    metric(found, "worker_kv_blocks", state="cached") > 0 and \
                    metric(found, "worker_kv_blocks", state="used") == 0 and \
                    metric(found, "worker_num_requests_running", lane="interactive") == 0   # gauges: within 1 s
            assert await eventually(settled, timeout=15, interval=0.2), \
                (generated, cached, prefilled, {k: v for k, v in found.items() if "token" in k[0] or "kv" in k[0]})

        assert generated >= 3 * 16 + 5           # every token generated counted once (settled: equal)
        assert metric(found, "worker_prompt_tokens_total") == prefilled, (prefilled, cached)   # cache hits not
        assert metric(found, "worker_prefix_cache_hits_total") == cached > 0    # the same prompt, 4 times
        assert metric(found, "worker_step_duration_seconds_count", kind="prefill") >= 1
        assert metric(found, "worker_step_duration_seconds_count", kind="decode") >= 10
        assert metric(found, "worker_batch_size_count") >= 16
        assert metric(found, "worker_batch_size_sum") > metric(found, "worker_batch_size_count")   # some steps batched
        assert metric(found, "worker_iteration_tokens_count", kind="decode") >= 10
        for name in ("worker_time_to_first_token_seconds_count", "worker_time_to_first_meaningful_token_seconds_count",
                     "worker_request_queue_time_seconds_count", "worker_time_per_output_token_seconds_count"):
            assert metric(found, name) >= 3, name
        assert metric(found, "worker_request_success_total", finish_reason="length") == 3
        assert metric(found, "worker_request_success_total", finish_reason="cancelled") == 1
        assert metric(found, "worker_cancels_total") == 1
        # received after we sent it, applied before its final was written (which we then read)
        assert 0 <= metric(found, "worker_cancel_latency_seconds_sum") <= cancel_seen - cancel_sent
        assert metric(found, "worker_output_commit_requests_count") > 0
        assert metric(found, "worker_engine_healthy") == 1
        assert metric(found, "worker_kv_cache_usage_perc") == 0       # nothing runs now
        assert metric(found, "worker_kv_blocks", state="used") == 0
        assert metric(found, "worker_prefix_cache_queries_total") > metric(found, "worker_prefix_cache_hits_total") > 0
        assert metric(found, "worker_num_requests_running", lane="interactive") == 0
        assert metric(found, "worker_claims_total") == 0 and metric(found, "worker_fenced_writes_total") == 0
        assert ("process_start_time_seconds", ()) in found
    finally:
        proc.stop()


def test_every_documented_worker_metric_is_exported_and_every_exported_one_documented():
    from pathlib import Path
    import re
    doc = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    documented = set(re.findall(r"^\| `(worker_[a-z0-9_]+)(?:\{[^}]*\})?` \|", doc, re.MULTILINE))
    exported = {f.name + ("_total" if f.type == "counter" else "")
                for f in WorkerMetrics().registry.collect() if f.name.startswith("worker_")}
    assert documented == exported, (sorted(documented - exported), sorted(exported - documented))


async def test_a_taken_port_leaves_the_worker_running_without_metrics():
    metrics = WorkerMetrics()
    port = metrics.serve("127.0.0.1", 0, "")
    try:
        assert port and (await asyncio.to_thread(httpx.get, f"http://127.0.0.1:{port}/metrics")).status_code == 200
        assert WorkerMetrics().serve("127.0.0.1", port, "") is None
    finally:
        metrics.close()
