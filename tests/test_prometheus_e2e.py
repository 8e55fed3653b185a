"""End to end with a real Prometheus (issue 27 item 5): Debian's `prometheus` binary scrapes a
scripts/stack.py stack (its gateway and its worker, behind ADMIN_TOKEN); traffic including a
cancel goes through the gateway; Prometheus' HTTP API then shows the worker's and the gateway's
series moved: tokens, batch sizes, a cancel-latency observation, TTFT."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from shared.localredis import free_port
from tests.gateway_client import GatewayClient, eventually

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = shutil.which("prometheus")
TOKEN = "prom-e2e-token"

pytestmark = pytest.mark.skipif(PROMETHEUS is None,
                                reason="prometheus not installed (Debian package `prometheus`: scripts/setup.sh)")


def start_stack(run_dir: Path, model_dir) -> tuple[subprocess.Popen, dict]:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env.update({"MODEL_PATH": str(model_dir), "DEVICE": "cpu", "TORCH_THREADS": "1", "MAX_BATCH": "8",
                "STREAM_PREFIX": f"prom{uuid.uuid4().hex[:6]}", "GATEWAY_HOST": "127.0.0.1", "ADMIN_TOKEN": TOKEN,
                "PYTHONUNBUFFERED": "1"})
    state_file = run_dir / "stack.json"
    log = open(run_dir / "stack.log", "wb")
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "stack.py"), "--gateway-port", "0",
                             "--worker-metrics-port", "-1", "--run-dir", str(run_dir), "--state-file", str(state_file),
                             "--ready-timeout", "150", "--grace", "20"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while not state_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"stack.py did not start:\n{(run_dir / 'stack.log').read_text()[-4000:]}")
        time.sleep(0.2)
    return proc, json.loads(state_file.read_text())


def start_prometheus(tmp: Path, state: dict) -> tuple[subprocess.Popen, str]:
    (tmp / "token").write_text(TOKEN)
    auth = {"type": "Bearer", "credentials_file": str(tmp / "token")}
    worker_target = state["workers"][0]["metrics_url"].removeprefix("http://").removesuffix("/metrics")
    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
              "scrape_configs": [
                  {"job_name": "gateway", "authorization": auth,
                   "static_configs": [{"targets": [f"127.0.0.1:{state['gateways'][0]['port']}"]}]},
                  {"job_name": "worker", "authorization": auth, "static_configs": [{"targets": [worker_target]}]}]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(tmp / "prometheus.log", "wb")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}/api/v1"


async def test_prometheus_sees_the_worker_and_gateway_series_move(tmp_path, tiny_model_dir):
    (tmp_path / "stack").mkdir()
    stack, state = start_stack(tmp_path / "stack", tiny_model_dir)
    prom, api = start_prometheus(tmp_path, state)
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            async def value(query: str) -> float:
                try:
                    result = (await http.get(f"{api}/query", params={"query": query})).json()["data"]["result"]
                except (httpx.HTTPError, ValueError, KeyError):
                    return -1.0
                return float(result[0]["value"][1]) if result else -1.0

            async def both_up() -> bool:
                return await value('sum(up{job="gateway"}) + sum(up{job="worker"})') == 2
            assert await eventually(both_up, timeout=60, interval=0.5), (tmp_path / "prometheus.log").read_text()[-2000:]

            c = await GatewayClient.connect(state["gateways"][0]["url"])
            for i in range(3):
                await c.send(type="generate", id=f"r{i}", prompt=f"Story {i}:", max_tokens=12, temperature=0)
            await c.send(type="generate", id="long", prompt="A long story:", max_tokens=1500, temperature=0)
            for i in range(3):
                assert (await c.until_done(f"r{i}", timeout=60))[1]["type"] == "done"
            chunk = await c.recv("long", timeout=60)
            while chunk["type"] != "chunk":
                chunk = await c.recv("long", timeout=60)
            await c.send(type="cancel", id="long")
            assert (await c.until_done("long", timeout=60))[1]["finish_reason"] == "cancelled"
            await c.close()

            expected = {
                "sum(worker_generation_tokens_total)": 3 * 12,
                "sum(worker_prompt_tokens_total)": 1,
                "sum(worker_batch_size_count)": 12,
                "sum(worker_cancel_latency_seconds_count)": 1,
                "sum(worker_time_to_first_token_seconds_count)": 4,
                'sum(worker_request_success_total{finish_reason="cancelled"})': 1,
                "sum(worker_output_commit_requests_count)": 1,
                "sum(gateway_ttft_seconds_count)": 4,
                'sum(gateway_cancels_total{origin="client"})': 1,
                "sum(gateway_tokens_sent_total)": 3 * 12,
            }
            seen: dict[str, float] = {}

            async def moved() -> bool:
                for query, at_least in expected.items():
                    seen[query] = await value(query)
                return all(seen[q] >= n for q, n in expected.items())
            assert await eventually(moved, timeout=30, interval=0.5), seen
            # a latency a dashboard would show: the worker's TTFT p95 over the traffic
            assert 0 < await value("histogram_quantile(0.95, sum by (le) (rate(worker_time_to_first_token_seconds_bucket[5m])))") < 60
    finally:
        for proc in (prom, stack):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
