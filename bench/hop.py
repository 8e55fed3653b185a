"""The worker's side of the worker -> gateway hop, counted: round trips, Redis commands, bytes and
client CPU per commit, and what a gateway's inbox reader waits, for two code trees in one run.

Why counted: the hop's wall time on a shared 2-core box is mostly scheduler wake-ups (each round
trip is two process switches), which the load moves by 2-5x between runs; the number of round
trips and commands a flush costs does not move. Each cell runs in a child process with
PYTHONPATH set to its tree (this checkout, or `--baseline-root`), alternating, on one Redis:

* N requests (`--streams`), each with a request entry pending in the consumer group, a meta
  hash (epoch 1) and a concurrency lease, as a worker holds them;
* the real `OutputWriter` commits their lifecycle, all N in every commit: `first` (one token
  each: the urgent first-token write), `mid` x `--mids` (3 tokens each: a coalesced tick),
  `final` (a last token and the final event: history, live, lease, ack);
* per commit: round trips (sends on the writer's connections: a pipeline is one send), bytes
  sent, Redis commands (INFO commandstats, commands inside scripts included), the writer's CPU
  (process time around `commit`, median of `--reps`), and, in a second pass with the gateway's
  real `Inbox` reader on the same event loop, the wall time from the commit's start to the
  moment the reader has every request's event (`deliver`, median).

    .venv/bin/python bench/hop.py --baseline-root /tmp/base      # /tmp/base: `git archive main | tar -x`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path and "--child" not in sys.argv:    # a child imports the tree on its PYTHONPATH
    sys.path.insert(0, str(ROOT))

PHASES = ("first", "mid", "final")


def counting_client(url: str):
    """A writer's client (as worker.redis_io makes it: hiredis packing, no reply timeout) whose
    connections count what they put on the wire: one send per round trip (a pipeline is one);
    tests/test_worker_output_writer.py counts with it too."""
    from shared.redis_client import connect
    client = connect(url, socket_timeout=None)
    sends: list = []
    base = client.connection_pool.connection_class

    class Counting(base):
        async def send_packed_command(self, command, check_health=True):
            sends.append(command)
            return await super().send_packed_command(command, check_health)

    client.connection_pool.connection_class = Counting
    return client, sends


async def commands(admin) -> int:
    stats = await admin.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k != "cmdstat_info")


async def one_pass(url: str, n: int, mids: int, with_reader: bool) -> dict[str, list[dict]]:
    """One lifecycle of n requests through a fresh writer; per phase, per commit, its figures."""
    from gateway.inbox import Inbox
    from shared.config import Settings
    from shared.redis_client import connect
    from shared.sampling import SamplingParams
    from shared.streams import CONSUMER_GROUP, ENTRY_FIELD, Keys, RequestEntry
    from worker.engine import StepOutput
    from worker.events import InFlight, Progress
    from worker.output_writer import OutputWriter

    prefix = f"hop{uuid.uuid4().hex[:6]}"
    keys = Keys(prefix)
    admin = connect(url)
    client, sends = counting_client(url)
    reader_client = connect(url, socket_timeout=None)
    arrived: dict[str, tuple[int, float]] = {}
    reader = None
    try:
        await admin.xgroup_create(keys.requests, CONSUMER_GROUP, id="0", mkstream=True)
        rids = [f"r{i}" for i in range(n + 1)]          # r0 warms the writer up (script load)
        for rid in rids:
            entry = RequestEntry(rid=rid, params=SamplingParams(), prompt="x", key_id="k", gw="g")
            await admin.xadd(keys.requests, {ENTRY_FIELD: entry.encode()})
        got = await admin.xreadgroup(CONSUMER_GROUP, "w", {keys.requests: ">"}, count=len(rids))
        states = []
        for (entry_id, _f), rid in zip(got[0][1], rids):
            await admin.hset(keys.meta(rid), mapping={"owner": "w", "epoch": 1})
            await admin.zadd(keys.conc("k"), {rid: 1})
            states.append(InFlight.start(rid, entry_id.decode(), None, Progress(), epoch=1, gw="g", key_id="k"))
        if with_reader:
            reader = Inbox(reader_client, keys.inbox("g"), block_ms=1000)
            for rid in rids:
                reader.subscribe(rid, lambda ev, rid=rid: arrived.__setitem__(rid, (ev.seq, time.perf_counter())))
            reader.start()
            while not reader.healthy:
                await asyncio.sleep(0.01)
        writer = OutputWriter(client, keys, Settings(stream_prefix=prefix), "w")
        warm, states = states[0], states[1:]
        warm.add_output(StepOutput(warm.rid, " w", [1], False, None, 1, 1))
        await writer.commit([warm])
        seq = 0
        out: dict[str, list[dict]] = {p: [] for p in PHASES}
        for phase in ["first"] + ["mid"] * mids + ["final"]:
            k = 1 if phase != "mid" else 3
            for st in states:
                for i in range(k):
                    st.add_output(StepOutput(st.rid, f" t{seq + i + 1}", [seq + i + 1], False, None, 1, seq + i + 1))
                if phase == "final":
                    st.add_output(StepOutput(st.rid, "", [], True, "length", 1, seq + k))
            seq += k
            sends.clear()
            calls0 = await commands(admin)
            cpu0, t0 = time.process_time(), time.perf_counter()
            await writer.commit(states)
            cpu1, t1 = time.process_time(), time.perf_counter()
            row = {"round_trips": len(sends), "bytes": sum(len(b) if isinstance(b, (bytes, bytearray))
                                                           else sum(map(len, b)) for b in sends),
                   "commit_ms": (t1 - t0) * 1000, "cpu_us": (cpu1 - cpu0) * 1e6}
            if reader is not None:
                deadline = time.monotonic() + 10
                while any(arrived.get(st.rid, (0, 0))[0] < seq for st in states) and time.monotonic() < deadline:
                    await asyncio.sleep(0)
                row["deliver_ms"] = statistics.median((arrived[st.rid][1] - t0) * 1000 for st in states)
            row["redis_cmds"] = await commands(admin) - calls0 - 1     # less the INFO's own count
            out[phase].append(row)
        assert all(st.final_written for st in states)
        return out
    finally:
        if reader is not None:
            await reader.stop()
        for c in (admin, client, reader_client):
            await c.aclose()


async def child(url: str, n: int, mids: int, reps: int) -> dict:
    """Figures of one tree: counts from the first pass (they do not vary), medians of the rest."""
    rows: dict[str, list[dict]] = {p: [] for p in PHASES}
    for rep in range(reps):
        for with_reader in (False, True):
            got = await one_pass(url, n, mids, with_reader)
            for p in PHASES:
                rows[p] += got[p]
    result = {}
    for p in PHASES:
        result[p] = {key: statistics.median(r[key] for r in rows[p] if key in r)
                     for key in ("round_trips", "bytes", "redis_cmds", "commit_ms", "cpu_us", "deliver_ms")}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-root", type=Path, default=None, help="another checkout to compare with")
    ap.add_argument("--streams", default="1,256", help="requests carried by every commit")
    ap.add_argument("--mids", type=int, default=3, help="coalesced ticks between the first token and the final")
    ap.add_argument("--reps", type=int, default=9, help="passes per tree and cell (medians)")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the trees")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        url, n, mids, reps = args.child
        print(json.dumps(asyncio.run(child(url, int(n), int(mids), int(reps)))))
        return
    from bench.common import table, write_json
    from shared.localredis import LocalRedis
    trees = ([("base", args.baseline_root.resolve())] if args.baseline_root else []) + [("this", ROOT)]
    server = LocalRedis().start()
    rows = []
    try:
        for n in [int(x) for x in args.streams.split(",")]:
            for rnd in range(args.rounds):
                for name, tree in trees:
                    env = dict(os.environ, PYTHONPATH=str(tree))
                    res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", server.url, str(n),
                                          str(args.mids), str(args.reps)], cwd=tree, env=env, capture_output=True,
                                         text=True, check=True)
                    for phase, fig in json.loads(res.stdout.strip().splitlines()[-1]).items():
                        rows.append({"tree": name, "round": rnd + 1, "streams": n, "commit": phase, **fig})
                        print(rows[-1], flush=True)
    finally:
        server.stop()
    for row in rows:
        base = [r for r in rows if r["tree"] == trees[0][0] and r["streams"] == row["streams"]
                and r["commit"] == row["commit"]]
        for key in ("cpu_us", "deliver_ms"):
            row[f"{key}_ratio"] = round(row[key] / statistics.mean(r[key] for r in base), 2)
        row["cpu_us_per_request"] = round(row["cpu_us"] / row["streams"], 1)
    cols = ["tree", "round", "streams", "commit", "round_trips", "redis_cmds", "bytes", "cpu_us", "cpu_us_per_request",
            "cpu_us_ratio", "commit_ms", "deliver_ms", "deliver_ms_ratio"]
    print(table(rows, cols))
    print("wrote", write_json("hop", {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}))


if __name__ == "__main__":
    main()
