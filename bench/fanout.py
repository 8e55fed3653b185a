"""Transport v2 fan-out: one gateway process fed at GPU pace, v2 against v1 in the same run.

Per cell (streams x step_ms x mode) this starts, on its own Redis:
* a token source at GPU pace, one token per stream per step:
  - `v2`, `v2-flush0`: `python -m worker.synthetic` (the REAL worker service and output writer
    around a synthetic engine; realistic token text), WORKER_FLUSH_MS = --flush-ms or 0;
  - `v1`: the baseline commit's synthetic writer (its bench/flush.py `--produce`: one XADD per
    token per request to `{p}:out:{rid}`), run from a temporary `git worktree` of that commit;
* one gateway process (`v1`: the baseline commit's gateway, with its per-request-key XREAD);
* client processes (separate from the gateway), each with many WebSockets, 8 streams a socket.

Reported per cell: gateway CPU (cores = CPU seconds / wall seconds over the run; µs a delivered
token), the gateway's write syscalls a second (/proc io: socket sends), Redis commands
per delivered token (INFO commandstats, every command, before/after), chunk frames/s, tokens per
frame, the client-observed gap between consecutive chunks of a stream (p50/p95/p99), and the
achieved token rate. Then, on the tiny model (a real `python -m worker`), the TTFT the hop adds,
per request with nothing else running: `submit` = generate sent -> `accepted` received, and
`deliver` = the worker emitted the first token (its event's `ms`) -> the client has it; `hop` =
submit + deliver (the rest of TTFT is the worker's intake and prefill).

    .venv/bin/python bench/fanout.py                               # the full matrix (~10 min)
    .venv/bin/python bench/fanout.py --streams 256 --steps 5 --seconds 5 --modes v2,v1
    # this tree against another checkout, alternating: cells, then the TTFT hop three times each
    .venv/bin/python bench/fanout.py --streams 256 --steps 5 --modes base,v2,base,v2 --baseline-root /tmp/base \
        --ttft-modes base,v2 --ttft-rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import redis  # noqa: E402

from bench.common import percentile, table, write_json  # noqa: E402
from shared.localredis import LocalRedis, free_port  # noqa: E402

# `python -c` this: the gateway under cProfile timed by the process's CPU time, not wall time
# (which a loaded box inflates wherever a function happens to be preempted, a socket write say),
# written to $GW_PROFILE_OUT when the gateway exits (SIGTERM)
PROFILED_GATEWAY = """
import cProfile, os, time
from gateway.__main__ import main
prof = cProfile.Profile(time.process_time)
try:
    prof.runcall(main)
except SystemExit:
    pass
finally:
    prof.dump_stats(os.environ["GW_PROFILE_OUT"])
"""
BASELINE_COMMIT = "793780d"      # `main` when transport v2 started: v1's read path and writer
STREAMS_PER_SOCKET = 8


# ---------------------------------------------------------------- client process

async def client_main(url: str, first: int, streams: int, tokens: int, out_path: str) -> None:
    import websockets

    gaps: list[float] = []
    totals = {"tokens": 0, "frames": 0, "errors": 0}

    async def one_socket(base_idx: int, n: int) -> None:
        async with websockets.connect(url, subprotocols=["llm-stream.json"], max_size=None, ping_interval=None,
                                      open_timeout=120) as ws:
            for i in range(n):
                await ws.send(json.dumps({"type": "generate", "id": f"s{base_idx + i}", "prompt": "Bench:",
                                          "max_tokens": tokens, "temperature": 1.0, "seed": base_idx + i}))
            last: dict[str, float] = {}
            open_ids = n
            while open_ids:
                msg = json.loads(await asyncio.wait_for(ws.recv(), 120))
                kind = msg["type"]
                if kind == "chunk":
                    now = time.monotonic()
                    prev = last.get(msg["id"])
                    if prev is not None:
                        gaps.append(now - prev)
                    last[msg["id"]] = now
                    totals["tokens"] += msg["tokens"]
                    totals["frames"] += 1
                elif kind == "done":
                    open_ids -= 1
                elif kind == "error":
                    totals["errors"] += 1
                    open_ids -= 1

    async def guarded(job) -> None:
        try:
            await job
        except Exception:               # a stream that stalls or a socket that drops: counted, not fatal
            totals["errors"] += 1

    jobs, idx = [], first
    remaining = streams
    while remaining > 0:
        n = min(STREAMS_PER_SOCKET, remaining)
        jobs.append(guarded(one_socket(idx, n)))
        idx += n
        remaining -= n
    await asyncio.gather(*jobs)
    Path(out_path).write_text(json.dumps({"gaps": gaps, **totals}))


# ---------------------------------------------------------------- processes

def popen(args: list[str], cwd: Path, env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=cwd, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(p: subprocess.Popen, grace: float = 5.0) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def base_env(tree: Path, redis_url: str, prefix: str, extra: dict) -> dict:
    env = dict(os.environ)
    env.update({"PYTHONPATH": str(tree), "REDIS_URL": redis_url, "STREAM_PREFIX": prefix, "PYTHONUNBUFFERED": "1"})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def wait_ready(port: int, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"gateway not ready:\n{log.read_text()[-3000:]}")


def wait_workers(r: redis.Redis, key: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if r.zcard(key):
            return
        time.sleep(0.1)
    raise RuntimeError(f"no worker registered in {key}")


def redis_calls(r: redis.Redis) -> int:
    stats = r.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_info",))


def gateway_env(extra: dict | None = None) -> dict:
    env = {"FLUSH_INTERVAL_MS": 40, "FLUSH_MAX_TOKENS": 24, "HEARTBEAT_S": 0, "PER_KEY_CONCURRENCY": 0,
           "PER_KEY_RATE_PER_MIN": 0, "MAX_QUEUE_DEPTH": 100000, "MAX_TOKENS_CAP": 100000,
           "MAX_REQUESTS_PER_SOCKET": 64, "GATEWAY_HOST": "127.0.0.1"}
    env.update(extra or {})
    return env


def run_cell(mode: str, streams: int, step_ms: float, args, redis_url: str, v1_tree: Path, work: Path) -> dict:
    prefix = f"fo{uuid.uuid4().hex[:6]}"
    tree = {"v1": v1_tree, "base": args.baseline_root}.get(mode, ROOT)
    r = redis.Redis.from_url(redis_url)
    tokens = max(20, int(args.seconds * 1000 / step_ms))
    port = free_port()
    procs = []
    spy = None
    try:
        if mode == "v1":
            src = popen([sys.executable, "bench/flush.py", "--produce", "--redis", redis_url, "--prefix", prefix,
                         "--step-ms", str(step_ms)], tree, base_env(tree, redis_url, prefix, {}), work / f"src-{prefix}.log")
            workers_key = f"{prefix}:workers"
        else:
            flush = 0 if mode == "v2-flush0" else args.flush_ms
            wtree = args.baseline_root if mode == "v2-gw" else tree     # v2-gw: this gateway, the base worker
            src = popen([sys.executable, "-m", "worker.synthetic", "--step-ms", str(step_ms), "--max-batch",
                         str(streams + 64)], wtree, base_env(wtree, redis_url, prefix, {"WORKER_FLUSH_MS": flush}),
                        work / f"src-{prefix}.log")
            workers_key = f"{prefix}:{{reg}}:workers"
        procs.append(src)
        wait_workers(r, workers_key)
        gw_log = work / f"gw-{prefix}.log"
        largest = streams == max(int(x) for x in args.streams.split(",") if x)
        gw_env = gateway_env({"GATEWAY_PORT": port})
        run_gw = ["-m", "gateway"]
        if args.profile and mode in ("v2", "base") and largest:
            run_gw = ["-c", PROFILED_GATEWAY]
            gw_env["GW_PROFILE_OUT"] = f"{args.profile}.{mode}.{streams}x{step_ms:g}ms.{prefix}.prof"
        gw = popen([sys.executable, *run_gw], tree, base_env(tree, redis_url, prefix, gw_env), gw_log)
        procs.append(gw)
        wait_ready(port, gw, gw_log)
        url = f"ws://127.0.0.1:{port}/v1/stream"
        gwp = psutil.Process(gw.pid)
        if args.py_spy and mode == "v2" and largest:
            out = Path(args.py_spy).with_suffix(f".{streams}x{step_ms:g}ms.txt")
            spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(gw.pid),
                                    "--format", "raw", "--nonblocking", "--rate", "400", "-o", str(out)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        calls0 = redis_calls(r)
        cpu0 = gwp.cpu_times()
        writes0 = gwp.io_counters().write_count     # write syscalls: socket sends included
        t0 = time.monotonic()
        n_clients = max(1, min(args.clients, streams // STREAMS_PER_SOCKET))
        outs, clients = [], []
        per = streams // n_clients
        for c in range(n_clients):
            n = per if c < n_clients - 1 else streams - per * (n_clients - 1)
            out = work / f"client-{prefix}-{c}.json"
            outs.append(out)
            clients.append(popen([sys.executable, str(Path(__file__).resolve()), "--client", url, str(c * per), str(n),
                                  str(tokens), str(out)], ROOT, base_env(ROOT, redis_url, prefix, {}),
                                 work / f"client-{prefix}.log"))
        for c in clients:
            c.wait(600)
        wall = time.monotonic() - t0
        if spy is not None:
            spy.send_signal(signal.SIGINT)      # py-spy writes its profile on SIGINT
            spy.wait(30)
        cpu1 = gwp.cpu_times()
        writes1 = gwp.io_counters().write_count
        calls1 = redis_calls(r)
        gaps, tok, frames, errors = [], 0, 0, 0
        for out in outs:
            if not out.exists():
                errors += 1
                continue
            data = json.loads(out.read_text())
            gaps += data["gaps"]
            tok += data["tokens"]
            frames += data["frames"]
            errors += data["errors"]
        cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
        return {
            "mode": mode, "streams": streams, "step_ms": step_ms, "tokens": tok, "errors": errors, "wall_s": wall,
            "target_tok_per_s": streams * 1000 / step_ms, "tok_per_s": tok / wall,
            "gw_cores": cpu / wall, "gw_us_per_tok": cpu * 1e6 / max(1, tok),
            "gw_writes_per_s": (writes1 - writes0) / wall, "redis_cmd_per_tok": (calls1 - calls0) / max(1, tok),
            "frames_per_s": frames / wall, "tok_per_frame": tok / max(1, frames),
            "gap_p50_ms": percentile(gaps, 50) * 1000, "gap_p95_ms": percentile(gaps, 95) * 1000,
            "gap_p99_ms": percentile(gaps, 99) * 1000,
        }
    finally:
        for p in reversed(procs):
            stop(p, 60.0 if args.profile else 5.0)
        r.close()


# ---------------------------------------------------------------- TTFT on the tiny model

async def ttft_requests(url: str, n: int, out: list) -> None:
    import websockets
    async with websockets.connect(url, subprotocols=["llm-stream.json"], ping_interval=None) as ws:
        for i in range(n):
            t_send = time.time()
            await ws.send(json.dumps({"type": "generate", "id": f"t{i}", "prompt": f"Hello {i}", "max_tokens": 4,
                                      "temperature": 0.0}))
            rid, t_acc, t_first = None, None, None
            while True:
                msg = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if msg["type"] == "accepted":
                    rid, t_acc = msg["request_id"], time.time()
                elif msg["type"] == "chunk" and t_first is None:
                    t_first = time.time()
                elif msg["type"] in ("done", "error"):
                    break
            out.append((rid, t_send, t_acc, t_first))
            await asyncio.sleep(0.05)


def run_ttft(mode: str, args, redis_url: str, v1_tree: Path, work: Path, model_dir: Path) -> dict:
    import msgpack
    prefix = f"ft{uuid.uuid4().hex[:6]}"
    tree = {"v1": v1_tree, "base": args.baseline_root}.get(mode, ROOT)
    r = redis.Redis.from_url(redis_url)
    port = free_port()
    procs = []
    try:
        wenv = {"MODEL_PATH": str(model_dir), "DEVICE": "cpu", "TORCH_THREADS": "1", "WORKER_ID": f"w-{prefix}",
                "WORKER_FLUSH_MS": args.flush_ms}
        procs.append(popen([sys.executable, "-m", "worker"], tree, base_env(tree, redis_url, prefix, wenv),
                           work / f"worker-{prefix}.log"))
        wait_workers(r, f"{prefix}:workers" if mode == "v1" else f"{prefix}:{{reg}}:workers", timeout=120)
        gw_log = work / f"gw-{prefix}.log"
        gw = popen([sys.executable, "-m", "gateway"], tree,
                   base_env(tree, redis_url, prefix, gateway_env({"GATEWAY_PORT": port})), gw_log)
        procs.append(gw)
        wait_ready(port, gw, gw_log)
        rows: list = []
        asyncio.run(ttft_requests(f"ws://127.0.0.1:{port}/v1/stream", args.ttft_requests, rows))
        submit, deliver, ttft = [], [], []
        for rid, t_send, t_acc, t_first in rows[3:]:          # the first few warm the model up
            key = f"{prefix}:out:{rid}" if mode == "v1" else f"{prefix}:{{r:{rid}}}:out"
            first = next((msgpack.unpackb(f[b"d"]) for _, f in r.xrange(key, count=5)
                          if msgpack.unpackb(f[b"d"]).get("k") == "tok"), None)
            if first is None or t_first is None:
                continue
            submit.append((t_acc - t_send) * 1000)
            deliver.append(t_first * 1000 - first["ms"])
            ttft.append((t_first - t_send) * 1000)
        hop = [a + b for a, b in zip(submit, deliver)]
        return {"mode": mode, "requests": len(hop), "submit_p50_ms": percentile(submit, 50),
                "deliver_p50_ms": percentile(deliver, 50), "deliver_p95_ms": percentile(deliver, 95), "hop_p50_ms": percentile(hop, 50),
                "hop_p95_ms": percentile(hop, 95), "ttft_p50_ms": percentile(ttft, 50)}
    finally:
        for p in reversed(procs):
            stop(p)
        r.close()


# ---------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="256,1000,2000")
    ap.add_argument("--steps", default="5,2", help="ms per decode step")
    ap.add_argument("--modes", default="v2,v2-flush0,v1",
                    help="v2 (WORKER_FLUSH_MS=--flush-ms), v2-flush0, v1, base (--baseline-root's tree, like v2), "
                         "v2-gw (this gateway fed by the base tree's worker: the gateway alone against base)")
    ap.add_argument("--flush-ms", type=int, default=15)
    ap.add_argument("--seconds", type=float, default=6.0, help="how long each stream runs (tokens = seconds/step)")
    ap.add_argument("--clients", type=int, default=4, help="client processes")
    ap.add_argument("--ttft-requests", type=int, default=23)
    ap.add_argument("--no-ttft", action="store_true")
    ap.add_argument("--ttft-modes", default="v2,v1", help="v2 (this tree), v1, base (--baseline-root's tree)")
    ap.add_argument("--ttft-rounds", type=int, default=1, help="alternations of the TTFT modes")
    ap.add_argument("--baseline-root", type=Path, default=None,
                    help="another checkout (e.g. `git archive main | tar -x -C /tmp/base`) for the `base` mode")
    ap.add_argument("--py-spy", default="", help="record a py-spy profile (collapsed stacks) of the v2 gateway "
                                                 "in the largest cell to this path prefix")
    ap.add_argument("--profile", default="", help="run the v2 (and base) gateway of the largest cell under "
                                                  "cProfile, timed by CPU time: <path>.<mode>.<cell>.<prefix>.prof")
    ap.add_argument("--client", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        url, first, n, tokens, out = args.client
        asyncio.run(client_main(url, int(first), int(n), int(tokens), out))
        return

    work = Path(tempfile.mkdtemp(prefix="bench-fanout-"))
    v1_tree = work / "v1"
    ttft_modes = [] if args.no_ttft else args.ttft_modes.split(",")
    needs_v1 = ("v1" in args.modes.split(",") and args.streams) or "v1" in ttft_modes
    if needs_v1:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(v1_tree), BASELINE_COMMIT],
                       check=True, capture_output=True)
    server = LocalRedis().start()
    rows, ttft_rows = [], []
    try:
        for step in [float(s) for s in args.steps.split(",")]:
            for streams in [int(s) for s in args.streams.split(",") if s]:
                for mode in args.modes.split(","):
                    row = run_cell(mode, streams, step, args, server.url, v1_tree, work)
                    rows.append(row)
                    print(f"{mode:10} streams={streams:<5} step={step:g}ms  tok/s={row['tok_per_s']:8.0f} "
                          f"(target {row['target_tok_per_s']:.0f})  gw cores={row['gw_cores']:.2f} "
                          f"({row['gw_us_per_tok']:.2f} us/tok, {row['gw_writes_per_s']:.0f} writes/s)  "
                          f"redis cmd/tok={row['redis_cmd_per_tok']:.3f}  tok/frame={row['tok_per_frame']:.1f}  "
                          f"gap p50/p95/p99={row['gap_p50_ms']:.0f}/{row['gap_p95_ms']:.0f}/{row['gap_p99_ms']:.0f}ms"
                          f"  errors={row['errors']}", flush=True)
        if ttft_modes:
            from tests.tiny_model import make_tiny_model_dir
            model_dir = make_tiny_model_dir(work / "tiny-model")
            for _ in range(args.ttft_rounds):
                for mode in ttft_modes:
                    row = run_ttft(mode, args, server.url, v1_tree, work, model_dir)
                    ttft_rows.append(row)
                    print(f"TTFT {mode}: hop p50 {row['hop_p50_ms']:.1f} ms (submit {row['submit_p50_ms']:.1f} + "
                          f"deliver {row['deliver_p50_ms']:.1f}, p95 {row['deliver_p95_ms']:.1f}), "
                          f"TTFT p50 {row['ttft_p50_ms']:.1f} ms", flush=True)
    finally:
        server.stop()
        if needs_v1:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(v1_tree)], capture_output=True)

    columns = ["mode", "streams", "step_ms", "tok_per_s", "target_tok_per_s", "gw_cores", "gw_us_per_tok",
               "gw_writes_per_s", "redis_cmd_per_tok",
               "frames_per_s", "tok_per_frame", "gap_p50_ms", "gap_p95_ms", "gap_p99_ms", "errors"]
    if rows:
        print()
        print(table(rows, columns))
    if ttft_rows:
        print()
        print(table(ttft_rows, ["mode", "requests", "submit_p50_ms", "deliver_p50_ms", "deliver_p95_ms", "hop_p50_ms",
                                "hop_p95_ms",
                                "ttft_p50_ms"]))
    path = write_json("fanout", {"baseline": f"v1 = commit {BASELINE_COMMIT}; v2-flush0 = WORKER_FLUSH_MS=0",
                                 "flush_ms": args.flush_ms, "rows": rows, "ttft": ttft_rows, "work_dir": str(work)})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
