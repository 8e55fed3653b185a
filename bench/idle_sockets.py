"""What an idle WebSocket costs a gateway: RSS and CPU per held socket (issue 13, "Also").

One run starts its own Redis and one tiny-model worker, then for each gateway variant:
`python -m gateway` as a subprocess, a warm-up request, its RSS; then `--sockets` idle sockets
opened from `--clients` client processes (each socket reads what it gets, answers protocol pings,
sends nothing); after `--settle` seconds the gateway's RSS, and its CPU time over `--window`
seconds (HEARTBEAT_S `--heartbeat`, so the window covers several heartbeat rounds); then one
more socket streams a request, to check the gateway still serves while holding them all.

Baseline in the same run: the gateway of `--baseline` (default: `main`), checked out into a
temporary `git worktree`, against the same Redis (its idle path only: its data path may differ
from this branch's worker, so its stream check may say "n/a"). ratio = this / baseline.

    .venv/bin/python bench/idle_sockets.py                      # 5000 sockets, baseline main
    .venv/bin/python bench/idle_sockets.py --sockets 1000 --window 20 --no-baseline
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import table, write_json  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS        # utime + stime


# ---------------------------------------------------------------- client process

async def hold(url: str, n: int) -> None:
    """Open n idle sockets, print READY, keep them (reading whatever comes) until stdin closes."""
    import websockets

    socks = []

    async def drain(ws):
        try:
            async for _ in ws:
                pass
        except websockets.ConnectionClosed:
            pass

    async def one():
        for attempt in range(20):
            try:
                ws = await websockets.connect(url, subprotocols=["llm-stream.json"], ping_interval=None,
                                              open_timeout=30, max_queue=4)
                socks.append(ws)
                asyncio.get_running_loop().create_task(drain(ws))
                return
            except (OSError, asyncio.TimeoutError, websockets.InvalidStatus):
                await asyncio.sleep(0.2 * (attempt + 1))
        raise RuntimeError("could not connect")

    for i in range(0, n, 100):
        await asyncio.gather(*[one() for _ in range(min(100, n - i))])
    print(f"READY {len(socks)}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for ws in socks:
        ws.transport.abort()


# ---------------------------------------------------------------- one variant

async def stream_check(url: str) -> tuple[str, float]:
    import websockets
    try:
        async with websockets.connect(url, subprotocols=["llm-stream.json"]) as ws:
            t0 = time.monotonic()
            await ws.send(json.dumps({"type": "generate", "id": "probe", "prompt": "Once upon a time",
                                      "max_tokens": 16, "temperature": 0}))
            ttft, tokens = None, 0
            while True:
                msg = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if msg["type"] == "chunk":
                    tokens += msg["tokens"]
                    ttft = ttft if ttft is not None else time.monotonic() - t0
                elif msg["type"] in ("done", "error"):
                    ok = msg["type"] == "done" and msg.get("finish_reason") in ("length", "stop") and tokens > 0
                    return ("ok" if ok else f"n/a ({msg.get('code') or msg.get('error', {}).get('code')})",
                            (ttft or 0) * 1000)
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"failed ({type(exc).__name__})", 0.0


def run_variant(name: str, tree: Path, redis_url: str, prefix: str, args, log_dir: Path) -> dict:
    from shared.localredis import free_port
    from tests.stack_fixtures import wait_http_ok

    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(tree), REDIS_URL=redis_url, STREAM_PREFIX=prefix,
               GATEWAY_HOST="127.0.0.1", GATEWAY_PORT=str(port), HEARTBEAT_S=str(args.heartbeat),
               MAX_SOCKETS_PER_ADDRESS="0", PER_KEY_CONCURRENCY="0", PYTHONUNBUFFERED="1")
    log = open(log_dir / f"gateway-{name}.log", "wb")
    gw = subprocess.Popen([sys.executable, "-m", "gateway"], cwd=tree, env=env, stdout=log,
                          stderr=subprocess.STDOUT, start_new_session=True)
    clients: list[subprocess.Popen] = []
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/readyz", timeout=60)
        url = f"ws://127.0.0.1:{port}/v1/stream"
        asyncio.run(stream_check(url))                       # warm-up: imports, first request
        time.sleep(1.0)
        rss0 = rss_bytes(gw.pid)
        per = -(-args.sockets // args.clients)
        t_open = time.monotonic()
        for i in range(args.clients):
            n = min(per, args.sockets - i * per)
            clients.append(subprocess.Popen([sys.executable, __file__, "--client", url, str(n)], cwd=ROOT,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                            start_new_session=True))
        opened = 0
        for c in clients:
            line = c.stdout.readline()
            if not line.startswith("READY"):
                raise RuntimeError(f"client failed: {line!r}")
            opened += int(line.split()[1])
        open_s = time.monotonic() - t_open
        time.sleep(args.settle)
        rss1 = rss_bytes(gw.pid)
        cpu0, t0 = cpu_seconds(gw.pid), time.monotonic()
        time.sleep(args.window)
        cpu1, t1 = cpu_seconds(gw.pid), time.monotonic()
        rss2 = rss_bytes(gw.pid)
        stream, ttft_ms = asyncio.run(stream_check(url))
        held = max(rss1, rss2) - rss0
        return {"variant": name, "sockets": opened, "open_s": round(open_s, 1), "rss_before_mb": rss0 / 2**20,
                "rss_held_mb": max(rss1, rss2) / 2**20, "kb_per_socket": held / opened / 1024,
                "cpu_pct_core": 100 * (cpu1 - cpu0) / (t1 - t0), "stream": stream, "ttft_ms": ttft_ms}
    finally:
        for c in clients:
            try:
                c.stdin.close()
            except OSError:
                pass
        for c in clients:
            try:
                c.wait(20)
            except subprocess.TimeoutExpired:
                c.kill()
        gw.terminate()
        try:
            gw.wait(20)
        except subprocess.TimeoutExpired:
            gw.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sockets", type=int, default=5000)
    ap.add_argument("--clients", type=int, default=4, help="client processes holding the sockets")
    ap.add_argument("--heartbeat", type=float, default=12.0)
    ap.add_argument("--settle", type=float, default=5.0)
    ap.add_argument("--window", type=float, default=36.0, help="CPU sampling window, seconds")
    ap.add_argument("--baseline", default="main", help="git ref of the baseline gateway")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--client", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        asyncio.run(hold(args.client[0], int(args.client[1])))
        return

    from shared.localredis import LocalRedis
    from tests.stack_fixtures import start_worker
    from tests.tiny_model import make_tiny_model_dir

    tmp = Path(tempfile.mkdtemp(prefix="idle-sockets-"))
    redis = LocalRedis().start()
    prefix = "idle"
    worker = start_worker(redis.url, prefix, make_tiny_model_dir(tmp / "model"), tmp, name="worker")
    rows = []
    base_tree = None
    try:
        if not args.no_baseline:
            base_tree = tmp / "baseline"
            subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), args.baseline], cwd=ROOT,
                           check=True, capture_output=True)
            rows.append(run_variant(f"baseline ({args.baseline})", base_tree, redis.url, prefix, args, tmp))
        rows.append(run_variant("this branch", ROOT, redis.url, prefix, args, tmp))
    finally:
        worker.stop()
        redis.stop()
        if base_tree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, capture_output=True)
    if len(rows) == 2:
        base, this = rows
        for key in ("kb_per_socket", "cpu_pct_core"):
            this[f"{key}_ratio"] = this[key] / base[key] if base[key] else float("nan")
    columns = ["variant", "sockets", "open_s", "rss_before_mb", "rss_held_mb", "kb_per_socket", "cpu_pct_core",
               "stream", "ttft_ms"]
    print(table(rows, columns))
    if len(rows) == 2:
        print(f"ratio this/baseline: KB per socket {rows[1]['kb_per_socket_ratio']:.2f}, "
              f"CPU {rows[1]['cpu_pct_core_ratio']:.2f}")
    print(f"load average after: {os.getloadavg()}")
    path = write_json("idle_sockets", {"args": vars(args), "rows": rows, "loadavg": os.getloadavg()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
