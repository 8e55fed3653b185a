"""A rolling upgrade and a scale-in, driven the way Kubernetes drives the Helm chart's pods, with
real processes (redis-server, `python -m gateway`, `python -m worker.synthetic`) and clients
(the Python SDK) whose streams run throughout; every stream must end exactly as the worker
recorded it (the fault tests' checker), and the time each stalled is printed.

What Kubernetes does, and what stands in for it here:
- a Service: `Service` below, a TCP proxy as kube-proxy makes one: each new connection goes to
  one ready endpoint (round robin), established ones stay where they are;
- a Deployment's rolling update (maxSurge 1, maxUnavailable 0): start the new pod and wait until
  it is ready (a gateway's /readyz, a worker in the registry), then terminate an old one;
- terminating a pod: its endpoint leaves the Service (preStop keeps it serving while that
  propagates: here the removal is immediate), then SIGTERM, then SIGKILL after the pod's
  terminationGracePeriodSeconds; every process here must exit by itself, with 0, before that;
- scaling workers 3 -> 1 (KEDA lowering the replica count): two pods terminated at once.

The grace periods and the environment are the chart's (`helm template`), with one change:
SHUTDOWN_GRACE_S (workers.shutdownGraceSeconds) of 2 s instead of 30 s, so that the workers'
hand-back happens within the test (the chart derives terminationGracePeriodSeconds from it).

Nothing here waits on a clock: each step waits for events (a stream's first chunk, a worker
owning a stream, a process's exit). The synthetic engine makes one token per stream every
STEP_MS at most, so a stream of TOKENS tokens is certain to be running when a drain starts right
after its first chunk (it cannot finish in less than TOKENS * STEP_MS), and certain to outlive a
worker's 2 s grace: every drained worker hands streams back, every drained gateway moves sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass, field

import pytest

from llm_stream_client import StreamClient
from shared.routing import rendezvous
from shared.streams import Keys
from tests.gateway_client import eventually
from tests.helm_chart import env_of, one, render
from tests.stack_fixtures import Proc, start_gateway, start_synthetic_worker
from tests.worker_redis import check_client_stream, check_seqs, owner_of, pending_after_acks
from worker.synthetic import token_at

pytestmark = pytest.mark.timeout(420)

STEP_MS = 20                 # one token per stream per 20 ms at most
TOKENS = 400                 # >= 8 s per stream: longer than any drain step waits for it
STREAMS_PER_WAVE = 3
SHUTDOWN_GRACE_S = 2


class Service:
    """A Kubernetes Service as kube-proxy makes one, for WebSockets: a new connection goes to the
    next ready endpoint (round robin) and stays there until one side closes it."""

    def __init__(self) -> None:
        self.endpoints: list[int] = []          # gateway ports, in the order they became ready
        self.placed: list[int] = []             # the endpoint of each connection, in order
        self._next = itertools.count()
        self._pipes: set[asyncio.Task] = set()
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"ws://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1/stream"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.endpoints:
            writer.close()
            return
        port = self.endpoints[next(self._next) % len(self.endpoints)]
        self.placed.append(port)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@dataclass
class Stream:
    """One generation as its client saw it: chunks with their arrival times."""
    wave: str
    gen: object
    chunks: list[dict] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    result: object = None
    task: asyncio.Task | None = None
    handed_back: bool = False           # it ran on a worker that was then drained

    async def consume(self) -> None:
        async for chunk in self.gen:
            self.arrivals.append(time.monotonic())
            self.chunks.append({"text": chunk.text, "seq": chunk.seq, "tokens": chunk.tokens})
        self.result = self.gen.result

    @property
    def stall_s(self) -> float:
        """The longest wait between two chunks (0 for a stream of one chunk)."""
        return max((b - a for a, b in zip(self.arrivals, self.arrivals[1:])), default=0.0)


def chart_pods() -> dict:
    """From the chart (helm template): the gateway's and the CPU worker's environment values and
    grace periods (secrets, addresses, ids and ports are the fixtures' business)."""
    docs = list(render("default", "--set", f"workers.shutdownGraceSeconds={SHUTDOWN_GRACE_S}"))
    out = {}
    for name in ("gateway", "worker-cpu"):
        spec = one(docs, "Deployment", f"-{name}")["spec"]["template"]["spec"]
        env = {k: e["value"] for k, e in env_of(spec["containers"][0]).items() if "value" in e}
        for local in ("GATEWAY_HOST", "GATEWAY_PORT", "WORKER_ID", "WORKER_METRICS_PORT", "HOME", "STREAM_PREFIX"):
            env.pop(local, None)
        out[name] = {"env": env, "grace": spec["terminationGracePeriodSeconds"]}
    assert float(out["worker-cpu"]["env"]["SHUTDOWN_GRACE_S"]) == SHUTDOWN_GRACE_S
    return out


def terminate(proc: Proc, grace: float) -> int | None:
    """SIGTERM, then SIGKILL after `grace` (the pod's terminationGracePeriodSeconds): the exit
    status, negative where the process had to be killed."""
    return proc.stop(grace=grace)


async def test_rolling_upgrade_and_scale_in_lose_no_stream(redis_server, redis_client, stream_prefix, tmp_path):
    keys = Keys(stream_prefix)
    pods = chart_pods()
    # the test's clients share one anonymous key and address: lift the per-key caps for them
    gw_env = {**pods["gateway"]["env"], "PER_KEY_CONCURRENCY": 1000, "PER_KEY_RATE_PER_MIN": 100000}
    worker_env = pods["worker-cpu"]["env"]
    gw_grace, worker_grace = pods["gateway"]["grace"], pods["worker-cpu"]["grace"]
    url, prefix = redis_server.url, stream_prefix

    service = Service()
    service_url = await service.start()
    gateways: dict[int, Proc] = {}      # port -> gateway
    workers: dict[str, Proc] = {}       # id -> worker
    clients: list[StreamClient] = []
    streams: list[Stream] = []
    numbers = itertools.count()
    ever_started: list[str] = []        # every worker id: a gateway's routing snapshot may lag

    async def start_gateway_pod() -> int:
        proc, base = await asyncio.to_thread(start_gateway, url, prefix, tmp_path, name=f"gw{next(numbers)}",
                                             env=gw_env)                # returns once /readyz is 200
        port = int(base.rsplit(":", 1)[1])
        gateways[port] = proc
        service.endpoints.append(port)
        return port

    async def start_worker_pod() -> str:
        wid = f"w{next(numbers)}"
        ever_started.append(wid)
        proc = await asyncio.to_thread(start_synthetic_worker, url, prefix, tmp_path, name=wid, env=worker_env,
                                       step_ms=STEP_MS, max_batch=64)    # returns once registered
        workers[wid] = proc
        return wid

    async def terminate_gateway_pod(port: int) -> None:
        service.endpoints.remove(port)                  # the endpoint goes first; preStop; SIGTERM
        rc = await asyncio.to_thread(terminate, gateways.pop(port), gw_grace)
        assert rc == 0, f"gateway :{port} did not drain within {gw_grace} s (exit {rc})"

    async def terminate_worker_pods(*wids: str) -> None:
        rcs = await asyncio.gather(*(asyncio.to_thread(terminate, workers.pop(w), worker_grace) for w in wids))
        assert rcs == [0] * len(wids), f"workers {wids} did not drain within {worker_grace} s: {rcs}"

    async def wave(name: str, *, to_gateway: int | None = None) -> list[Stream]:
        """STREAMS_PER_WAVE new streams on a new client, each once its first chunk arrived;
        `to_gateway`: on a socket the Service gave that gateway (clients are opened until one
        lands there)."""
        for _ in range(len(service.endpoints) + 1):
            client = StreamClient(service_url, max_reconnect_attempts=50, backoff_max_s=1.0)
            clients.append(client)
            await client.connect()
            if to_gateway is None or service.placed[-1] == to_gateway:
                break
        else:
            raise AssertionError(f"no connection landed on gateway :{to_gateway}")
        return await start_streams(client, name, [f"{name}-{i}" for i in range(STREAMS_PER_WAVE)])

    async def start_streams(client: StreamClient, name: str, cache_keys: list[str]) -> list[Stream]:
        started = []
        for key in cache_keys:
            stream = Stream(name, client.generate(f"{name}: {key}", max_tokens=TOKENS, temperature=0.0,
                                                  prompt_cache_key=key))
            stream.task = asyncio.create_task(stream.consume())
            started.append(stream)
        streams.extend(started)
        assert await eventually(lambda: all(s.chunks or s.task.done() for s in started), timeout=60), name
        return started

    async def wave_on_worker(name: str, wid: str) -> list[Stream]:
        """Streams until `wid` runs some: each routed to it (a prompt_cache_key it wins the
        rendezvous hash for among every worker ever started, so among any set that holds it),
        which a gateway or worker with a stale view of the registry may not honour: a request is
        never made to wait for a worker. The ones it runs are marked to be handed back."""
        client = StreamClient(service_url, max_reconnect_attempts=50, backoff_max_s=1.0)
        clients.append(client)
        await client.connect()
        keys_for = (f"{name}-{k}" for k in itertools.count())
        for _ in range(5):
            batch = [next(k for k in keys_for if rendezvous(k, ever_started)[0] == wid)
                     for _ in range(STREAMS_PER_WAVE)]
            started = await start_streams(client, name, batch)
            for s in started:
                s.handed_back = await owner_of(redis_client, keys, s.gen.request_id) == wid
            if any(s.handed_back for s in started):
                return started
        raise AssertionError(f"no stream of {name} ran on {wid}")

    try:
        old_gateways = [await start_gateway_pod() for _ in range(2)]
        old_workers = [await start_worker_pod() for _ in range(3)]
        await wave("warm")

        # rolling update of the gateways: surge one, drain one, twice
        for old in old_gateways:
            await start_gateway_pod()
            await wave(f"gw{old}", to_gateway=old)
            await terminate_gateway_pod(old)

        # rolling update of the workers: streams on the old one, surge one, drain the old one (its
        # streams handed back), three times
        for old in old_workers:
            await wave_on_worker(f"{old}-drain", old)
            await start_worker_pod()
            await terminate_worker_pods(old)

        # scale-in 3 -> 1: two workers drain at once, the third continues all their streams
        doomed = list(workers)[:2]
        for wid in doomed:
            await wave_on_worker(f"{wid}-scale-in", wid)
        await terminate_worker_pods(*doomed)
        assert len(workers) == 1 and len(gateways) == 2

        await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), timeout=240)
        for s in streams:
            rid = s.gen.request_id
            assert s.result.finish_reason == "length", (s.wave, rid, s.result)
            done = {"seq": s.result.seq, "usage": s.result.usage}
            events = await check_client_stream(redis_client, keys, rid, s.chunks, done)
            check_seqs(events)
            assert s.result.usage["completion_tokens"] == TOKENS
            # the synthetic engine's n-th token is a function of n: a replayed or skipped token shows
            assert "".join(c["text"] for c in s.chunks) == "".join(token_at(n)[1] for n in range(1, TOKENS + 1))
            if s.handed_back:       # it ran on a worker that drained: another one finished it
                assert max(e["ep"] for e in events) >= 2, f"{s.wave}: not handed back to another worker"
        assert await pending_after_acks(redis_client, keys) == 0
        assert await redis_client.xlen(keys.dead) == 0

        by_wave: dict[str, list[float]] = {}
        for s in streams:
            by_wave.setdefault(s.wave, []).append(round(s.stall_s, 2))
        print(f"\nlongest stall of each stream (s), by the step it was started for: {by_wave}")
        # generous bound: a stream that waited for a SIGKILLed worker's claim, or a resume grace, would show
        assert max(s.stall_s for s in streams) < float(worker_env["CLAIM_IDLE_MS"]) / 1000, by_wave
    finally:
        for client in clients:
            with contextlib.suppress(Exception):
                await client.close()
        for proc in [*gateways.values(), *workers.values()]:
            proc.stop(grace=5)
        await service.stop()
