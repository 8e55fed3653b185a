"""Logs that join up (docs/operations.md, "Logs"): with LOG_FORMAT=json every line of the gateway,
the worker and its engine process is one JSON object, and the lines about a request carry its id
in `rid`, so one filter follows it through gateway -> worker -> gateway."""

from __future__ import annotations

import json
import uuid

from tests.gateway_client import GatewayClient, eventually
from tests.stack_fixtures import start_gateway, start_worker


async def test_json_logs_follow_one_request_through_both_processes(redis_server, tiny_model_dir, tmp_path):
    prefix = f"logs{uuid.uuid4().hex[:8]}"
    env = {"LOG_FORMAT": "json", "LOG_LEVEL": "DEBUG"}
    worker = start_worker(redis_server.url, prefix, tiny_model_dir, tmp_path, name="w-logs", env=env)
    gateway, base = start_gateway(redis_server.url, prefix, tmp_path, name="g-logs", env=env)
    try:
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
    finally:
        gateway.stop()
        worker.stop()
