"""Worker-side coalescing: Redis cost and added latency vs WORKER_FLUSH_MS, at GPU pace.

One run starts its own Redis; per (streams, step_ms, WORKER_FLUSH_MS) cell it starts a fresh
`python -m worker.synthetic` (the real worker service and output writer around a GPU-paced
synthetic engine: one token per stream per step), submits N requests to the request stream
naming one gateway "bench", and reads that gateway's inbox exactly as a gateway does (one
XREAD on one key, decoding event lists). Baseline: WORKER_FLUSH_MS=0 (a write per engine step)
in the same run.

Reported per cell: Redis commands per token (INFO commandstats, all commands incl. those run
inside the history script, before/after), inbox entries/s, tokens per event, worker CPU (cores,
user+sys of the worker process), the achieved step time, and the delivery delay = arrival in
the inbox reader - `ms` of the event (when the engine produced its oldest token): what
coalescing adds, plus the hop.

    .venv/bin/python bench/worker_flush.py                  # 256 streams, 5 ms steps, 0/5/10/15/20/30 ms
    .venv/bin/python bench/worker_flush.py --streams 64 --step-ms 2 --flush 0,15
    .venv/bin/python bench/worker_flush.py --flush 15 --baseline-root /tmp/base --repeat 2   # vs another commit
    .venv/bin/python bench/worker_flush.py --flush 15 --engine thread,process --host-us-per-row 10 --repeat 2

`cpu_ratio` compares worker CPU per token (`cpu_us_per_token`, the worker and its engine process),
not cores: a worker that keeps a faster pace uses more cores for the same work. `--engine
thread,process` compares the engine in a thread of the worker with the engine in its own process
(ENGINE_PROCESS), and `--host-us-per-row` gives the synthetic engine the real engine's Python work
per row, which is what competes with the Redis I/O for one GIL in thread mode.
"""

from __future__ import annotations

import argparse
import asyncio
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
import redis.asyncio as aioredis  # noqa: E402

from bench.common import percentile, table, write_json  # noqa: E402
from shared.localredis import LocalRedis  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402
from shared.streams import ENTRY_FIELD, Keys, RequestEntry, decode_event_list  # noqa: E402
from tests.stack_fixtures import Proc, _env, wait_for_worker  # noqa: E402


async def commands_total(r) -> int:
    stats = await r.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k.startswith("cmdstat_"))


def cpu_seconds(procs: list[psutil.Process]) -> float:
    """user + sys of the worker and its engine process (ENGINE_PROCESS), as far as still alive."""
    total = 0.0
    for p in procs:
        try:
            total += sum(p.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


async def run_cell(server: LocalRedis, work: Path, streams: int, step_ms: float, flush_ms: int,
                   max_tokens: int, root: Path = ROOT, env: dict | None = None, host_us_per_row: float = 0.0) -> dict:
    prefix = f"b{uuid.uuid4().hex[:6]}"
    keys = Keys(prefix)
    log_path = work / f"synthetic-{prefix}.log"
    host = ["--host-us-per-row", str(host_us_per_row)] if host_us_per_row else []
    popen = subprocess.Popen([sys.executable, "-m", "worker.synthetic", "--step-ms", str(step_ms),
                              "--max-batch", str(streams), *host], cwd=root, stdout=open(log_path, "ab"),
                             stderr=subprocess.STDOUT, start_new_session=True,
                             env=_env(server.url, prefix, {"WORKER_FLUSH_MS": flush_ms, "WORKER_ID": prefix,
                                                           **(env or {})}))
    proc = Proc(popen, log_path)
    r = aioredis.from_url(server.url)
    try:
        wait_for_worker(server.url, prefix, proc)
        ps = psutil.Process(proc.pid)
        procs = [ps, *ps.children(recursive=True)]
        rids = [uuid.uuid4().hex for _ in range(streams)]
        cmd0, cpu0, t0 = await commands_total(r), cpu_seconds(procs), time.monotonic()
        async with r.pipeline(transaction=False) as pipe:
            for rid in rids:
                pipe.xadd(keys.requests, {ENTRY_FIELD: RequestEntry(
                    rid=rid, params=SamplingParams(max_tokens=max_tokens), prompt="bench", gw="bench",
                    created_ms=int(time.time() * 1000)).encode()})
            await pipe.execute()
        open_rids, tokens, events, entries, delays = set(rids), 0, 0, 0, []
        last = "0-0"
        deadline = time.monotonic() + 120
        while open_rids and time.monotonic() < deadline:
            resp = await r.xread({keys.inbox("bench"): last}, block=1000, count=1000)
            now_ms = time.time() * 1000
            for _k, items in resp or []:
                for entry_id, fields in items:
                    last = entry_id
                    entries += 1
                    for ev in decode_event_list(fields[ENTRY_FIELD]):
                        if ev["k"] == "tok":
                            tokens += ev["n"]
                            events += 1
                            delays.append(now_ms - ev["ms"])
                        elif ev["k"] in ("done", "err"):
                            open_rids.discard(ev["rid"])
        wall = time.monotonic() - t0
        cpu = cpu_seconds(procs) - cpu0
        cmds = await commands_total(r) - cmd0
        steps = max_tokens  # one token per stream per step
        return {"streams": streams, "step_ms": step_ms, "flush_ms": flush_ms, "tokens": tokens,
                "unfinished": len(open_rids), "seconds": round(wall, 2),
                "achieved_step_ms": round(wall * 1000 / steps, 2),
                "tok_per_s": round(tokens / wall), "cmds_per_token": round(cmds / max(1, tokens), 4),
                "inbox_entries_per_s": round(entries / wall), "tokens_per_event": round(tokens / max(1, events), 2),
                "worker_cores": round(cpu / wall, 2), "cpu_us_per_token": round(1e6 * cpu / max(1, tokens), 2),
                "delay_p50_ms": round(percentile(delays, 50), 1), "delay_p95_ms": round(percentile(delays, 95), 1),
                "delay_p99_ms": round(percentile(delays, 99), 1)}
    finally:
        proc.stop()
        await r.aclose()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--flush", default="0,5,10,15,20,30")
    ap.add_argument("--max-tokens", type=int, default=600)
    ap.add_argument("--baseline-root", type=Path, default=None,
                    help="another checkout (e.g. `git worktree add /tmp/base main`): every cell also runs its "
                         "worker, alternating, and ratios compare with it instead of WORKER_FLUSH_MS=0")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each cell (per code tree)")
    ap.add_argument("--host-us-per-row", type=float, default=0.0,
                    help="the synthetic engine's Python work per row per step, holding the GIL (the real "
                         "engine's host time, bench/engine_host.py); 0 = none (older trees lack the option)")
    ap.add_argument("--engine", default="",
                    help="thread,process: run each cell with ENGINE_PROCESS=false and =true, alternating; "
                         "ratios compare with the first")
    args = ap.parse_args()
    server = LocalRedis().start()
    work = Path(tempfile.mkdtemp(prefix="bench-wflush-"))
    rows = []
    try:
        variants = [("baseline", args.baseline_root.resolve(), {})] if args.baseline_root else []
        modes = [m for m in args.engine.split(",") if m]
        variants += [(m, ROOT, {"ENGINE_PROCESS": str(m == "process").lower()}) for m in modes] or [("this", ROOT, {})]
        for flush_ms in [int(x) for x in args.flush.split(",")]:
            for _ in range(args.repeat):
                for code, root, env in variants:
                    rows.append({"code": code, **await run_cell(server, work, args.streams, args.step_ms, flush_ms,
                                                                args.max_tokens, root, env, args.host_us_per_row)})
                    print(rows[-1], flush=True)
    finally:
        server.stop()
    for row in rows:
        if len(variants) > 1:    # the same cell of the first variant (baseline tree, or thread; mean of its runs)
            same = [r for r in rows if r["code"] == variants[0][0] and r["flush_ms"] == row["flush_ms"]]
        else:                    # per-step writes (WORKER_FLUSH_MS=0) of this tree
            same = [r for r in rows if r["flush_ms"] == 0] or rows[:1]
        mean = lambda key: sum(r[key] for r in same) / len(same)  # noqa: E731
        row["cmds_ratio"] = round(row["cmds_per_token"] / mean("cmds_per_token"), 3)
        row["cpu_ratio"] = round(row["cpu_us_per_token"] / mean("cpu_us_per_token"), 2)
    cols = ["code", "streams", "step_ms", "flush_ms", "tokens", "seconds", "achieved_step_ms", "tok_per_s",
            "cmds_per_token", "cmds_ratio", "inbox_entries_per_s", "tokens_per_event", "worker_cores",
            "cpu_us_per_token", "cpu_ratio", "delay_p50_ms", "delay_p95_ms", "delay_p99_ms", "unfinished"]
    print(table(rows, cols))
    print("wrote", write_json(f"worker_flush_{args.streams}x{args.step_ms:g}ms", {"args": vars(args), "rows": rows}))


if __name__ == "__main__":
    asyncio.run(main())
