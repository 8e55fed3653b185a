"""Worker-kill failover: kill -> first claim, kill -> first token after the claim, with the
default settings (WORKER_TTL_S 2, WORKER_HEARTBEAT_S 0.5, CLAIM_IDLE_MS 15000).

One run starts its own Redis. Each trial starts a fresh victim (`python -m worker.synthetic`:
the real worker service, intake, claims and output writer around a paced fake engine), gives
it `--requests` endless streams and waits until every one has a token in its history; then a
survivor starts (it reads nothing: all entries are pending under the victim), and after a
random 0-1 s (so the kill falls anywhere in the heartbeat and keep-fresh cycles) the victim is
SIGKILLed. Measured from the kill (wall clock of this process; every process is on this host):

* first claim / all claimed: when the first / the last request's `meta.epoch` became 2 (the
  survivor's TAKE): the lease that TAKE set (Redis's clock, this host's) less the lease length,
  or when a poll (every 2 ms, one pipeline) first saw it, whichever is earlier (a keep-fresh
  may have extended the lease before the poll saw it);
* lapse: when the victim's last heartbeat (its registry score) turned WORKER_TTL_S old: the
  earliest any survivor may judge it dead; `claim after lapse` = first claim - lapse, the
  claim path's own latency (the rest is where the kill fell in the 0.5 s heartbeat cycle);
* first token / last first token: the `ms` (when the survivor's engine produced it) of the
  first epoch-2 token event in each request's history: earliest / latest over the requests.

`--baseline-root` runs another tree's workers (e.g. `git archive main | tar -x -C /tmp/base`)
alternating with this one, trial by trial, so both see the same load.

    .venv/bin/python bench/failover.py --kills 10 --baseline-root /tmp/base
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis.asyncio as aioredis  # noqa: E402

from bench.common import percentile, table, write_json  # noqa: E402
from shared.localredis import LocalRedis  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402
from shared.streams import ENTRY_FIELD, Keys, RequestEntry, decode_event  # noqa: E402
from tests.stack_fixtures import Proc, _env, wait_for_worker  # noqa: E402

POLL_S = 0.002
LEASE_MS = 1500     # WORKER_TTL_S - WORKER_HEARTBEAT_S with the default settings (worker.ownership)
TTL_MS = 2000       # WORKER_TTL_S by default


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def synthetic(server: LocalRedis, root: Path, work: Path, prefix: str, name: str, max_batch: int,
              step_ms: float) -> Proc:
    log_path = work / f"{prefix}-{name}.log"
    popen = subprocess.Popen([sys.executable, "-m", "worker.synthetic", "--step-ms", str(step_ms),
                              "--max-batch", str(max_batch)], cwd=root, stdout=open(log_path, "ab"),
                             stderr=subprocess.STDOUT, start_new_session=True,
                             env=_env(server.url, prefix, {"WORKER_ID": name, "PYTHONPATH": str(root)}))
    return Proc(popen, log_path)


async def first_epoch2_token_ms(r, keys: Keys, rid: str) -> int | None:
    for _id, fields in await r.xrange(keys.out(rid)):
        ev = decode_event(fields[ENTRY_FIELD])
        if ev["k"] == "tok" and ev["ep"] == 2:
            return int(ev["ms"])
    return None


async def trial(server: LocalRedis, r, work: Path, root: Path, args, rng: random.Random) -> dict:
    prefix = f"f{uuid.uuid4().hex[:6]}"
    keys = Keys(prefix)
    victim = synthetic(server, root, work, prefix, "victim", args.requests, args.step_ms)
    survivor = None
    try:
        wait_for_worker(server.url, prefix, victim)
        rids = [uuid.uuid4().hex for _ in range(args.requests)]
        async with r.pipeline(transaction=True) as pipe:
            for rid in rids:
                pipe.xadd(keys.requests, {ENTRY_FIELD: RequestEntry(
                    rid=rid, params=SamplingParams(max_tokens=10**6, ignore_eos=True), prompt="bench",
                    created_ms=int(time.time() * 1000)).encode()})
            await pipe.execute()
        while not all([await r.exists(keys.out(rid)) for rid in rids]):
            await asyncio.sleep(0.05)
        survivor = synthetic(server, root, work, prefix, "survivor", args.survivor_batch, args.step_ms)
        wait_for_worker(server.url, prefix, survivor, count=2)
        await asyncio.sleep(rng.uniform(0, 1.0))
        killed_ms = time.time() * 1000
        victim.popen.kill()
        victim.popen.wait()
        lapse_ms = float(await r.zscore(keys.workers, "victim")) + TTL_MS - killed_ms
        claimed: dict[str, float] = {}
        deadline = time.monotonic() + 30
        while len(claimed) < len(rids) and time.monotonic() < deadline:
            async with r.pipeline(transaction=False) as pipe:
                for rid in rids:
                    pipe.hmget(keys.meta(rid), "epoch", "lease")
                metas = await pipe.execute()
            now_ms = time.time() * 1000
            for rid, (epoch, lease) in zip(rids, metas):
                if rid not in claimed and epoch is not None and int(epoch) >= 2:
                    claimed[rid] = min(now_ms, int(lease) - LEASE_MS) - killed_ms
            await asyncio.sleep(POLL_S)
        tokens: dict[str, float] = {}
        while len(tokens) < len(rids) and time.monotonic() < deadline:
            for rid in rids:
                if rid not in tokens and (ms := await first_epoch2_token_ms(r, keys, rid)) is not None:
                    tokens[rid] = ms - killed_ms
            await asyncio.sleep(0.05)
        first = min(claimed.values(), default=float("nan"))
        return {"first_claim_ms": first, "lapse_ms": lapse_ms, "claim_after_lapse_ms": first - lapse_ms,
                "all_claimed_ms": max(claimed.values()) if len(claimed) == len(rids) else float("nan"),
                "first_token_ms": min(tokens.values(), default=float("nan")),
                "last_first_token_ms": max(tokens.values()) if len(tokens) == len(rids) else float("nan"),
                "claimed": len(claimed), "requests": len(rids)}
    finally:
        for p in (victim, survivor):
            if p is not None and p.alive():
                p.popen.kill()
                p.popen.wait()
        await r.flushdb()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=10, help="trials per code tree")
    ap.add_argument("--requests", type=int, default=32, help="requests the victim owns when it is killed")
    ap.add_argument("--survivor-batch", type=int, default=16, help="its MAX_BATCH (16 is the default)")
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--baseline-root", type=Path, default=None,
                    help="another tree (e.g. `git archive main | tar -x -C /tmp/base`), alternated with this one")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    variants = ([("baseline", args.baseline_root.resolve())] if args.baseline_root else []) + [("this", ROOT)]
    server = LocalRedis().start()
    r = aioredis.from_url(server.url)
    work = Path(tempfile.mkdtemp(prefix="bench-failover-"))
    trials: list[dict] = []
    try:
        for i in range(args.kills):
            for code, root in variants:
                trials.append({"code": code, "kill": i, **await trial(server, r, work, root, args, rng)})
                print(trials[-1], flush=True)
    finally:
        await r.aclose()
        server.stop()
    metrics = ["first_claim_ms", "lapse_ms", "claim_after_lapse_ms", "all_claimed_ms", "first_token_ms",
               "last_first_token_ms"]
    rows = []
    for code, _root in variants:
        mine = [t for t in trials if t["code"] == code]
        row = {"code": code, "kills": len(mine)}
        for m in metrics:
            values = [t[m] for t in mine if t[m] == t[m]]     # (nan: not every request got there)
            row[f"{m[:-3]} p50"] = round(percentile(values, 50)) if values else "-"
            row[f"{m[:-3]} max"] = round(max(values)) if values else "-"
        rows.append(row)
    cols = ["code", "kills"] + [f"{m[:-3]} {q}" for m in metrics for q in ("p50", "max")]
    print(f"CPU: {cpu_model()}; {args.requests} requests owned by the victim, survivor batch {args.survivor_batch}, "
          f"default settings; ms from the SIGKILL")
    print(table(rows, cols))
    print("wrote", write_json("failover", {"args": {k: str(v) for k, v in vars(args).items()}, "cpu": cpu_model(),
                                           "rows": rows, "trials": trials}))


if __name__ == "__main__":
    asyncio.run(main())
