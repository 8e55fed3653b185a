"""What one gateway process spends per token, replayed in lockstep so that every run does the
same work: the same inbox entries, events and frames, whatever the box's load.

bench/fanout.py paces a synthetic worker by the clock, so how many tokens an event and a frame
carry (the gateway's cost is per event and per frame, not per token) moves with the load of the
box, and so does its CPU per token. Here the bench process is the worker and the clients:

* S streams over WebSockets (8 a socket, as bench/fanout.py) submit `generate` to a real
  gateway (`python -m gateway` of this tree or `--baseline-root`'s), with a registered stand-in
  worker so admission admits them;
* the bench reads their request entries and then, per step, appends `--events` inbox entries to
  the gateway's inbox, each with one `tok` event of `--tokens` tokens for EVERY stream (what a
  worker's flush writes: one entry per gateway), then waits until every stream's chunk reached
  its client. The gateway's chunk buffer flushes by token count only (FLUSH_MAX_TOKENS =
  events x tokens, FLUSH_INTERVAL_MS = 10 min), so every step is exactly one frame a stream,
  sent at its last event however the gateway's reads batch the entries;
* measured over `--steps` steps after the first (first-chunk) one: the gateway's CPU time
  (user+sys) per token, and with `--callgrind` its instructions per token (valgrind, exact and
  load-independent; the run is then ~50x slower). Finals end every stream after the window.
  `--pace-ms 15` instead writes an entry every 15 ms (a worker's flush) and leaves frames to the
  gateway's default 40 ms timers, as in production: closer to it, but what a frame carries then
  depends on timing again (reported as tok_per_frame).

    .venv/bin/python bench/gateway_tokens.py --baseline-root /tmp/base --rounds 3
    .venv/bin/python bench/gateway_tokens.py --callgrind --baseline-root /tmp/base
    .venv/bin/python bench/gateway_tokens.py --profile /tmp/gw     # cProfile (CPU time) of this tree
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
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

from bench.common import table, write_json  # noqa: E402
from bench.fanout import PROFILED_GATEWAY, STREAMS_PER_SOCKET, base_env, gateway_env, popen, stop, wait_ready  # noqa: E402
from shared.events import DoneEvent, DoneUsage, TokEvent  # noqa: E402
from shared.localredis import LocalRedis, free_port  # noqa: E402
from shared.streams import ENTRY_FIELD, Keys, RequestEntry, pack_event_list  # noqa: E402
from worker.synthetic import token_at  # noqa: E402


class Clients:
    """S streams on S/8 WebSockets; counts the chunks each stream has received."""

    def __init__(self, url: str, streams: int):
        self.url, self.streams = url, streams
        self.chunks = [0] * streams
        self.tokens = 0
        self.done = 0
        self.changed = asyncio.Event()
        self.sockets: list = []
        self.tasks: list = []

    async def open(self) -> None:
        import websockets
        for first in range(0, self.streams, STREAMS_PER_SOCKET):
            ws = await websockets.connect(self.url, subprotocols=["llm-stream.json"], max_size=None,
                                          ping_interval=None, open_timeout=120)
            self.sockets.append(ws)
            for i in range(first, min(self.streams, first + STREAMS_PER_SOCKET)):
                await ws.send(json.dumps({"type": "generate", "id": str(i), "prompt": "Bench:", "max_tokens": 100000}))
            self.tasks.append(asyncio.create_task(self._read(ws)))

    async def _read(self, ws) -> None:
        async for frame in ws:
            msg = json.loads(frame)
            if msg["type"] == "chunk":
                self.chunks[int(msg["id"])] += 1
                self.tokens += msg["tokens"]
            elif msg["type"] in ("done", "error"):
                self.done += 1
            self.changed.set()

    async def wait(self, cond, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            self.changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the gateway did not deliver in time")
            try:
                await asyncio.wait_for(self.changed.wait(), min(left, 1.0))
            except asyncio.TimeoutError:
                pass

    async def close(self) -> None:
        for ws in self.sockets:
            await ws.close()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def heartbeat(r, keys: Keys) -> None:
    while True:
        await r.zadd(keys.workers, {"replay": int(time.time() * 1000)})
        await asyncio.sleep(0.5)


def callgrind_total(out: Path) -> int:
    """Instructions (Ir) in a callgrind dump: its `summary:` / `totals:` line."""
    text = out.read_text(errors="replace")
    m = re.search(r"^(?:summary|totals):\s+(\d+)", text, re.M)
    return int(m.group(1)) if m else 0


async def run(tree: Path, args, server: LocalRedis, work: Path, label: str) -> dict:
    prefix = f"gt{uuid.uuid4().hex[:6]}"
    keys = Keys(prefix)
    r = aioredis.from_url(server.url)
    beat = asyncio.create_task(heartbeat(r, keys))
    port = free_port()
    per_frame = args.events * args.tokens
    flush = {"FLUSH_INTERVAL_MS": 600000, "FLUSH_MAX_TOKENS": per_frame} if not args.pace_ms else {}
    env = gateway_env({"GATEWAY_PORT": port, "MAX_REQUESTS_PER_SOCKET": STREAMS_PER_SOCKET, "REQUEST_STALL_S": 3600,
                       "CACHE_ROUTING": "false", **flush})
    cmd = [sys.executable, "-m", "gateway"]
    cg_out = work / f"callgrind-{prefix}.out"
    if args.callgrind:
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={cg_out}", *cmd]
    elif args.profile and label == "this":
        cmd = [sys.executable, "-c", PROFILED_GATEWAY]
        env["GW_PROFILE_OUT"] = f"{args.profile}.prof"
    log = work / f"gw-{prefix}.log"
    gw = popen(cmd, tree, base_env(tree, server.url, prefix, env), log)
    clients = None
    try:
        await asyncio.to_thread(wait_ready, port, gw, log, 600 if args.callgrind else 60)
        clients = Clients(f"ws://127.0.0.1:{port}/v1/stream", args.streams)
        await clients.open()
        entries: list[RequestEntry] = []
        while len(entries) < args.streams:
            got = await r.xrange(keys.requests)
            entries = [RequestEntry.decode(f[ENTRY_FIELD]) for _, f in got]
            await asyncio.sleep(0.05)
        inbox = keys.inbox(entries[0].gw)
        seq = 0

        async def step(n_events: int) -> None:
            nonlocal seq
            for _ in range(n_events):
                ids = [token_at(seq + i)[0] for i in range(args.tokens)]
                text = [token_at(seq + i)[1] for i in range(args.tokens)]
                seq += args.tokens
                now = int(time.time() * 1000)
                events = [TokEvent(e.rid, seq, ids, "".join(text), 1, now, None, 3, bytes(len(t) for t in text)).encode()
                          for e in entries]
                await r.xadd(inbox, {ENTRY_FIELD: pack_event_list(events)}, maxlen=10000, approximate=True)

        await step(1)                                   # the first chunk of every stream
        await clients.wait(lambda: min(clients.chunks) >= 1)
        proc = psutil.Process(gw.pid)
        if args.callgrind:      # counts from here on: zeroed now, dumped after the window
            subprocess.run(["callgrind_control", "-z", str(gw.pid)], check=True, capture_output=True)
        cpu0, tok0, t0 = proc.cpu_times(), clients.tokens, time.monotonic()
        frames0 = sum(clients.chunks)
        if args.pace_ms:        # one entry every pace_ms for --steps x --events entries, by the clock
            for k in range(args.steps * args.events):
                await asyncio.sleep(max(0.0, t0 + k * args.pace_ms / 1000 - time.monotonic()))
                await step(1)
            await clients.wait(lambda: clients.tokens - tok0 >= args.steps * per_frame * args.streams)
        for k in range(0 if args.pace_ms else args.steps):
            await step(args.events)
            await clients.wait(lambda: min(clients.chunks) >= k + 2)
        cpu1, tokens, wall = proc.cpu_times(), clients.tokens - tok0, time.monotonic() - t0
        frames = sum(clients.chunks) - frames0
        instructions = 0
        if args.callgrind:
            subprocess.run(["callgrind_control", "-d", str(gw.pid)], check=True, capture_output=True)
            dumps = sorted(work.glob(f"callgrind-{prefix}.out*"), key=lambda p: p.stat().st_mtime)
            instructions = callgrind_total(dumps[-1])
        finals = [DoneEvent(e.rid, seq, "length", DoneUsage(3, seq), 1, int(time.time() * 1000)).encode()
                  for e in entries]
        await r.xadd(inbox, {ENTRY_FIELD: pack_event_list(finals)})
        await clients.wait(lambda: clients.done >= args.streams)
        cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
        events = args.steps * args.events * args.streams
        return {"tree": label, "streams": args.streams, "tokens": tokens, "events": events, "frames": frames,
                "tok_per_event": args.tokens, "tok_per_frame": round(tokens / frames, 2), "wall_s": round(wall, 2),
                "cpu_us_per_token": round(cpu * 1e6 / tokens, 2),
                "instr_per_token": round(instructions / tokens) if instructions else None}
    finally:
        if clients is not None:
            await clients.close()
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
        stop(gw, 120.0)
        await r.aclose()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=3, help="tokens per event (a worker flush at 15 ms / 5 ms steps)")
    ap.add_argument("--events", type=int, default=3, help="events per frame (a 40 ms chunk of 15 ms flushes)")
    ap.add_argument("--steps", type=int, default=40, help="frames per stream in the measured window")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the trees")
    ap.add_argument("--baseline-root", type=Path, default=None)
    ap.add_argument("--callgrind", action="store_true", help="count the gateway's instructions (valgrind)")
    ap.add_argument("--pace-ms", type=float, default=0.0,
                    help="instead of lockstep: an entry every PACE ms, the gateway's default flush policy "
                         "(FLUSH_INTERVAL_MS=40): frames by its timers, as in production (less exact)")
    ap.add_argument("--profile", default="", help="cProfile (CPU time) this tree's gateway to <path>.prof")
    args = ap.parse_args()
    trees = ([("base", args.baseline_root.resolve())] if args.baseline_root else []) + [("this", ROOT)]
    work = Path(tempfile.mkdtemp(prefix="bench-gwtok-"))
    server = LocalRedis().start()
    rows = []
    try:
        for _ in range(args.rounds):
            for label, tree in trees:
                rows.append(await run(tree, args, server, work, label))
                print(rows[-1], flush=True)
    finally:
        server.stop()
    for key in ("cpu_us_per_token", "instr_per_token"):
        base = [r[key] for r in rows if r["tree"] == trees[0][0] and r[key]]
        for row in rows:
            if base and row[key]:
                row[key.replace("per_token", "ratio")] = round(row[key] / (sum(base) / len(base)), 3)
    cols = ["tree", "streams", "tok_per_event", "tok_per_frame", "tokens", "wall_s", "cpu_us_per_token", "cpu_us_ratio",
            "instr_per_token", "instr_ratio"]
    print(table(rows, cols))
    print("wrote", write_json("gateway_tokens", {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                                 "cpu": os.popen("lscpu | grep 'Model name'").read().strip()}))


if __name__ == "__main__":
    asyncio.run(main())
