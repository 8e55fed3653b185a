"""Logs that join up (docs/operations.md, "Logs"): with LOG_FORMAT=json every line of the gateway,
the worker and its engine process is one JSON object, and the lines about a request carry its id
in `rid`, so one filter follows it through gateway -> worker -> gateway."""

from __future__ import annotations

import contextlib
import json
import uuid

import pytest

from tests.gateway_client import GatewayClient, eventually
from tests.stack_fixtures import start_gateway, start_worker


@contextlib.contextmanager
def json_logging(redis_url: str, model_dir, log_dir, name: str, level: str):
    """A worker (tiny model) and a gateway process, both logging JSON at `level`:
    (worker, gateway, the gateway's http base)."""
    prefix = f"{name}{uuid.uuid4().hex[:8]}"
    env = {"LOG_FORMAT": "json", "LOG_LEVEL": level}
    worker = start_worker(redis_url, prefix, model_dir, log_dir, name=f"w-{name}", env=env)
    try:
        gateway, base = start_gateway(redis_url, prefix, log_dir, name=f"g-{name}", env=env)
        try:
            yield worker, gateway, base
        finally:
            gateway.stop()
    finally:
        worker.stop()


async def test_json_logs_follow_one_request_through_both_processes(redis_server, tiny_model_dir, tmp_path):
    with json_logging(redis_server.url, tiny_model_dir, tmp_path, "logs", "DEBUG") as (worker, gateway, base):
        c = await GatewayClient.connect(base.replace("http", "ws") + "/v1/stream")
        await c.send(type="generate", id="traced", prompt="Once upon a time", max_tokens=8)
        rid = (await c.recv("traced"))["request_id"]
        await c.until_done("traced")
        await c.close()

        def lines(proc) -> list[dict]:
            return [json.loads(raw) for raw in proc.log().splitlines() if raw.strip()]   # every line is one object

        async def both_finished() -> bool:
            return any(r.get("rid") == rid and "finished" in r["message"] for r in lines(worker)) and \
                any(r.get("rid") == rid and "done" in r["message"] for r in lines(gateway))
        assert await eventually(both_finished, timeout=10)
        for proc, name in ((worker, "worker"), (gateway, "gateway")):
            records = lines(proc)
            assert records and all({"ts", "level", "logger", "message", "process", "pid"} <= set(r) for r in records)
            assert {r["process"] for r in records} <= {name, "engine"}
            mine = [r for r in records if r.get("rid") == rid]
            assert mine and all(rid in r["message"] for r in mine)
        assert any("taken" in r["message"] for r in lines(worker) if r.get("rid") == rid)
        assert any("queued" in r["message"] for r in lines(gateway) if r.get("rid") == rid)
        assert any(r["process"] == "engine" for r in lines(worker))       # the engine process logs JSON too


async def test_one_info_line_per_finished_request_with_worker_fields_and_cancel_latency(redis_server, tiny_model_dir,
                                                                                         tmp_path):
    """At INFO (no DEBUG line about requests), the gateway writes ONE JSON line per finished
    request joining its own timings with the worker's final (tokens, worker, lane, its TTFT,
    TTFMT, TTLT); a client's cancel frame and an HTTP client going away each add the cancel's
    origin and its end-to-end latency, and /metrics holds that latency by origin."""
    import httpx

    from tests.stack_fixtures import metric, metric_samples

    with json_logging(redis_server.url, tiny_model_dir, tmp_path, "reqlog", "INFO") as (_, gateway, base):
        c = await GatewayClient.connect(base.replace("http", "ws") + "/v1/stream")
        whole = await c.generate("whole", prompt="Once upon a time", max_tokens=8)
        await c.until_done("whole")
        stopped = await c.generate("stopped", prompt="Once upon a time", max_tokens=1800)
        await c.chunks("stopped", 1)          # running in the engine: it holds a slot
        await c.send(type="cancel", id="stopped")
        _, done = await c.until_done("stopped")
        assert done["finish_reason"] == "cancelled"
        await c.close()

        body = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 1800, "stream": True}
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                left = resp.headers["x-request-id"]
                async for line in resp.aiter_lines():
                    if line.startswith("data: {") and '"text": ""' not in line:
                        break             # a token arrived: it runs; now go away

            def finished() -> dict[str, dict]:
                out: dict[str, dict] = {}
                for raw in gateway.log().splitlines():
                    record = json.loads(raw)
                    if record["logger"] == "gateway.request_log":
                        assert record["rid"] not in out, f"two lines for one request: {record}"
                        out[record["rid"]] = record
                return out
            assert await eventually(lambda: {whole, stopped, left} <= set(finished()), timeout=20), \
                gateway.log()[-3000:]
            found = metric_samples((await http.get("/metrics")).text)

        lines = finished()
        ok = lines[whole]
        assert ok["level"] == "INFO" and ok["message"] == f"request {whole} finished" and ok["id"] == "whole"
        assert ok["finish_reason"] == "length" and ok["error"] is None and ok["seq"] == 8
        assert ok["completion_tokens"] == 8 and ok["prompt_tokens"] > 0 and ok["cached_tokens"] >= 0
        assert ok["worker"] == "w-reqlog" and ok["lane"] == "interactive" and ok["resumed"] is False
        assert 0 < ok["ttft_ms"] <= ok["ttlt_ms"] <= ok["total_ms"]
        assert ok["ttfmt_ms"] is None or ok["ttft_ms"] <= ok["ttfmt_ms"] <= ok["ttlt_ms"]
        assert 0 <= ok["w_ttft_ms"] <= ok["w_ttlt_ms"]
        assert ok["cancel"] is None and ok["cancel_ms"] is None

        cancelled = lines[stopped]
        assert cancelled["finish_reason"] == "cancelled" and cancelled["cancel"] == "client"
        assert cancelled["worker"] == "w-reqlog" and 0 < cancelled["completion_tokens"] < 1800
        assert 0 < cancelled["cancel_ms"] < cancelled["total_ms"]

        gone = lines[left]
        assert gone["finish_reason"] == "cancelled" and gone["cancel"] == "http_disconnect"
        assert gone["worker"] == "w-reqlog" and gone["cancel_ms"] > 0

        assert metric(found, "gateway_cancel_latency_seconds_count", origin="client") == 1
        assert metric(found, "gateway_cancel_latency_seconds_count", origin="http_disconnect") == 1
        assert metric(found, "gateway_cancel_latency_seconds_sum", origin="client") == \
            pytest.approx(cancelled["cancel_ms"] / 1000, abs=0.001)
        assert not [raw for raw in gateway.log().splitlines() if json.loads(raw)["level"] == "DEBUG"]
