"""Where one user's time to first token goes, leg by leg, through the real stack; two code trees
alternating in one run (`--baseline-root`) for an A/B of a change to the path.

Per round and tree, on one Redis: a real worker (`python -m worker`, the tiny random-weight model
unless `--model-path`) and a real gateway (`python -m gateway`), then one client sending
`--requests` generate frames one after another over one WebSocket (4 tokens each, 50 ms apart;
the first three warm up). Redis MONITOR stamps every command with the server's clock, the same
clock as the client's and the worker's `time.time()`, which splits each request's TTFT into:

* `gw_in`: the client sent `generate` -> its request entry's XADD reached Redis (the gateway's
  intake: frame parse, validation, admission, rate limit);
* `accepted`: that XADD -> the client has `accepted` (the pipeline's reply, the control frame);
* `worker_in`: that XADD -> the worker's claim script (its blocked XREADGROUP wakes, decodes,
  claims);
* `engine`: the claim -> the engine emitted the first token (its event's `ms`: intake, prefill,
  one decode step; 1 ms resolution);
* `worker_out`: the emit -> the worker's commit script carrying it reached Redis (engine process
  -> the worker's loop -> the output writer);
* `gw_out`: that commit -> the client has the first chunk (the gateway's inbox XREAD wakes,
  routes, its sender writes);
* `submit` = generate sent -> accepted; `deliver` = worker_out + gw_out; `hop` = submit + deliver
  (bench/fanout.py's TTFT figures, with the same definitions).

The event's `ms` is whole milliseconds, truncated: `engine` reads 0.5 ms short and `worker_out`
(so `deliver` and `hop`) 0.5 ms long on average, as in bench/fanout.py. MONITOR costs Redis a
little per command (the same for both trees). On a 2-core box every leg is mostly process
wake-ups, so read p50s, and p95s only across many requests and rounds.

    .venv/bin/python bench/ttft_legs.py --rounds 3
    .venv/bin/python bench/ttft_legs.py --baseline-root /tmp/base --rounds 3   # this tree against another
    .venv/bin/python bench/ttft_legs.py --baseline-root . --base-env ENGINE_PROCESS=false   # a setting
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import msgpack  # noqa: E402
import redis  # noqa: E402

from bench.common import percentile, table, write_json  # noqa: E402
from bench.fanout import base_env, gateway_env, popen, stop, ttft_requests, wait_ready, wait_workers  # noqa: E402
from shared.localredis import LocalRedis, free_port  # noqa: E402

LEGS = ("gw_in", "accepted", "worker_in", "engine", "worker_out", "gw_out", "submit", "deliver", "hop")
WARM_UP = 3


class Monitor:
    """Redis MONITOR in a thread: (server time, command words) of every command."""

    def __init__(self, url: str):
        self.lines: list[tuple[float, str]] = []
        self._client = redis.Redis.from_url(url)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with self._client.monitor() as mon:
                for cmd in mon.listen():
                    self.lines.append((cmd["time"], cmd["command"][:200]))
        except redis.ConnectionError:
            pass        # the server stopped: the run is over

    def start(self) -> "Monitor":
        self._thread.start()
        time.sleep(0.3)     # MONITOR is in effect once its reply came; the thread has no other signal
        return self


def legs_of(rows: list, lines: list[tuple[float, str]], out_key) -> list[dict]:
    """Each measured request's legs (ms), from the client's times and the commands naming it."""
    result = []
    for rid, t_send, t_acc, t_first in rows[WARM_UP:]:
        if rid is None or t_first is None:
            continue
        first = next((ev for ev in out_key(rid) if ev.get("k") == "tok"), None)
        cmds = [(t, c) for t, c in lines if rid in c and t >= t_send - 0.01]
        xadd = next((t for t, c in cmds if c.startswith("XADD") and ":requests" in c), None)
        scripts = [t for t, c in cmds if c.startswith("EVALSHA")]
        if first is None or xadd is None or len(scripts) < 2:
            continue
        claim = next(t for t in scripts if t >= xadd)
        emit = first["ms"] / 1000
        commit = next((t for t in scripts if t > claim and t >= emit), None)
        if commit is None:
            continue
        ms = {"gw_in": xadd - t_send, "accepted": t_acc - xadd, "worker_in": claim - xadd, "engine": emit - claim,
              "worker_out": commit - emit, "gw_out": t_first - commit, "submit": t_acc - t_send,
              "deliver": t_first - emit}
        ms["hop"] = ms["submit"] + ms["deliver"]
        result.append({k: v * 1000 for k, v in ms.items()})
    return result


def run_once(tree: Path, label: str, args, redis_url: str, model_dir: Path, work: Path,
             env: dict[str, str]) -> list[dict]:
    prefix = f"tl{uuid.uuid4().hex[:6]}"
    r = redis.Redis.from_url(redis_url)
    procs = []
    try:
        wenv = {"MODEL_PATH": str(model_dir), "DEVICE": "cpu", "WORKER_ID": f"w-{prefix}",
                "WORKER_FLUSH_MS": args.flush_ms, **({"TORCH_THREADS": "1"} if args.tiny else {}), **env}
        procs.append(popen([sys.executable, "-m", "worker"], tree, base_env(tree, redis_url, prefix, wenv),
                           work / f"worker-{label}-{prefix}.log"))
        wait_workers(r, f"{prefix}:{{reg}}:workers", timeout=300)
        port = free_port()
        gw_log = work / f"gw-{label}-{prefix}.log"
        gw = popen([sys.executable, "-m", "gateway"], tree,
                   base_env(tree, redis_url, prefix, gateway_env({"GATEWAY_PORT": port, **env})), gw_log)
        procs.append(gw)
        wait_ready(port, gw, gw_log)
        mon = Monitor(redis_url).start()
        rows: list = []
        asyncio.run(ttft_requests(f"ws://127.0.0.1:{port}/v1/stream", args.requests, rows))
        time.sleep(0.2)     # the last commands reach the monitor

        def out_events(rid: str) -> list[dict]:
            return [msgpack.unpackb(f[b"d"]) for _, f in r.xrange(f"{prefix}:{{r:{rid}}}:out", count=5)]
        return legs_of(rows, list(mon.lines), out_events)
    finally:
        for p in reversed(procs):
            stop(p)
        r.close()


def summarize(label: str, samples: list[dict]) -> dict:
    row = {"tree": label, "requests": len(samples)}
    for leg in LEGS:
        values = [s[leg] for s in samples]
        row[f"{leg}_p50"] = percentile(values, 50)
        row[f"{leg}_p95"] = percentile(values, 95)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=43, help="per round and tree (the first three warm up)")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the trees")
    ap.add_argument("--baseline-root", type=Path, default=None, help="another checkout, run as `base`")
    ap.add_argument("--model-path", default="", help="a model directory (default: the tiny random-weight model)")
    ap.add_argument("--flush-ms", type=int, default=40, help="the worker's WORKER_FLUSH_MS")
    ap.add_argument("--base-env", action="append", default=[], metavar="K=V",
                    help="an environment variable for the base tree's worker and gateway (repeatable)")
    ap.add_argument("--name", default="ttft_legs", help="bench/out/<name>.json")
    args = ap.parse_args()
    args.tiny = not args.model_path
    work = Path(tempfile.mkdtemp(prefix="bench-ttft-legs-"))
    if args.tiny:
        from tests.tiny_model import make_tiny_model_dir
        model_dir = make_tiny_model_dir(work / "tiny-model")
    else:
        model_dir = Path(args.model_path)
    base_env_vars = dict(kv.split("=", 1) for kv in args.base_env)
    trees = [("this", ROOT, {})] + ([("base", args.baseline_root.resolve(), base_env_vars)] if args.baseline_root else [])
    samples: dict[str, list[dict]] = {label: [] for label, _, _ in trees}
    server = LocalRedis().start()
    try:
        for _ in range(args.rounds):
            for label, tree, env in trees:
                got = run_once(tree, label, args, server.url, model_dir, work, env)
                samples[label] += got
                row = summarize(label, got)
                print(f"{label}: {len(got)} requests  hop p50 {row['hop_p50']:.2f} ms = submit {row['submit_p50']:.2f} "
                      f"(gw_in {row['gw_in_p50']:.2f}, accepted {row['accepted_p50']:.2f}) + deliver "
                      f"{row['deliver_p50']:.2f} (worker_out {row['worker_out_p50']:.2f}, gw_out {row['gw_out_p50']:.2f})",
                      flush=True)
    finally:
        server.stop()
    rows = [summarize(label, samples[label]) for label, _, _ in trees]
    print()
    print(table([{"leg": leg, **{f"{r['tree']} p50 / p95 ms": f"{r[f'{leg}_p50']:.2f} / {r[f'{leg}_p95']:.2f}"
                                 for r in rows}} for leg in LEGS], ["leg"] + [f"{r['tree']} p50 / p95 ms" for r in rows]))
    path = write_json(args.name, {"rows": rows, "base_env": base_env_vars, "samples": samples, "requests": args.requests, "rounds": args.rounds,
                                  "model": str(args.model_path or "tiny")})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
