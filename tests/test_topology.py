"""The deployment topology as real processes: 1 Redis + 2 gateways + 2 workers + nginx.

Started through scripts/stack.py — the same entry point as the README's run command — from one
set of environment settings (the tiny model via MODEL_PATH). Then:

- requests complete through each gateway directly and through the proxy, and the proxy spreads
  sockets over both gateways (the nginx config in deploy/nginx is the one under test);
- SIGTERM to a worker mid-stream: its requests finish (drained) or are handed back and finish on
  the other worker; the client gets every token exactly once, and the worker exits;
- SIGTERM to a gateway mid-stream: the client gets `shutting_down` + close 1012, reconnects
  through the proxy (landing on the other gateway), resumes from its last seq, and the text it
  ends up with is exactly what the workers wrote to Redis;
- SIGTERM to the stack shuts everything down cleanly (exit 0, no process left).

Tests in this module run in order on one stack (module-scoped fixture); each kills one process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis
import websockets

from shared.streams import META_OWNER, Keys, decode_event

ROOT = Path(__file__).resolve().parent.parent
STACK = ROOT / "scripts" / "stack.py"
sys.path.insert(0, str(ROOT / "scripts"))
from stack import nginx_binary  # noqa: E402


LONG = 1800  # tokens: a few seconds on the tiny model, long enough to interrupt mid-stream


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by stack.py) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


class Stack:
    """A running scripts/stack.py and what it wrote to its state file."""

    def __init__(self, proc: subprocess.Popen, state: dict, log: Path):
        self.proc, self.state, self.log = proc, state, log
        self.keys = Keys(state["stream_prefix"])
        self.redis = redis.Redis.from_url(state["redis_url"])

    def log_tail(self, n: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def gateway_http(self, gw: dict) -> str:
        return f"http://127.0.0.1:{gw['port']}"

    def out_text(self, rid: str) -> tuple[str, int]:
        """Text and token count the workers wrote for a request, straight from its Redis stream."""
        text, tokens = [], 0
        for _id, fields in self.redis.xrange(self.keys.out(rid)):
            ev = decode_event(fields[b"d"])
            if ev["k"] == "tok":
                text.append(ev["text"])
                tokens += ev["n"]
        return "".join(text), tokens


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    if nginx_binary() is None:
        pytest.skip("nginx not installed (scripts/setup.sh --proxy installs nginx-light)")
    run_dir = tmp_path_factory.mktemp("stack")
    log = run_dir / "stack.log"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # the stack starts its own Redis
    env.update({
        "MODEL_PATH": str(tiny_model_dir), "DEVICE": "cpu", "TORCH_THREADS": "1",
        "STREAM_PREFIX": f"topo{uuid.uuid4().hex[:6]}", "GATEWAY_HOST": "127.0.0.1",
        "RESUME_GRACE_S": "20", "HEARTBEAT_S": "2", "CLAIM_IDLE_MS": "3000",
        # a short drain, so a SIGTERMed worker hands its running requests back (the path under test)
        "SHUTDOWN_GRACE_S": "0.5",
        "MAX_BATCH": "8", "PYTHONUNBUFFERED": "1", "ALLOWED_ORIGINS": "https://app.example",
    })
    state_file = run_dir / "stack.json"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(STACK), "--gateways", "2", "--workers", "2", "--proxy", "--gateway-port", "0",
             "--proxy-port", "0", "--run-dir", str(run_dir), "--state-file", str(state_file), "--grace", "30",
             "--ready-timeout", "150", "--worker-metrics-port", "-1"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while not state_file.exists():
        if proc.poll() is not None:
            pytest.fail(f"stack.py exited with {proc.returncode} during start-up:\n{log.read_text()[-6000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"stack not ready in time:\n{log.read_text()[-6000:]}")
        time.sleep(0.2)
    s = Stack(proc, json.loads(state_file.read_text()), log)
    yield s
    s.redis.close()
    pids = [c["pid"] for c in s.state["gateways"] + s.state["workers"]] + [s.state["proxy"]["pid"]]
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pid in pids:  # never leave a child behind, whatever happened above
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------- a minimal protocol client

class Client:
    def __init__(self, ws):
        self.ws = ws
        self.chunks: dict[str, list[dict]] = {}
        self.done: dict[str, dict] = {}
        self.accepted: dict[str, str] = {}
        self.errors: list[dict] = []

    @classmethod
    async def connect(cls, url: str, origin: str | None = None) -> "Client":
        return cls(await websockets.connect(url, subprotocols=["llm-stream.json"], open_timeout=10, max_size=None,
                                            origin=origin))

    async def generate(self, cid: str, prompt: str, max_tokens: int) -> None:
        self.chunks.setdefault(cid, [])
        await self.ws.send(json.dumps({"type": "generate", "id": cid, "prompt": prompt, "max_tokens": max_tokens,
                                       "temperature": 0}))

    async def resume(self, cid: str, last_seq: int) -> None:
        self.chunks.setdefault(cid, [])
        await self.ws.send(json.dumps({"type": "resume", "id": cid, "last_seq": last_seq,
                                       "request_id": self.accepted[cid]}))

    async def pump(self, until, timeout: float) -> None:
        """Read frames until `until(self)` is true. Raises on timeout; returns when the socket closes."""
        async def loop():
            while not until(self):
                msg = json.loads(await self.ws.recv())
                kind = msg["type"]
                if kind == "chunk":
                    self.chunks[msg["id"]].append(msg)
                elif kind == "done":
                    self.done[msg["id"]] = msg
                elif kind == "accepted":
                    self.accepted[msg["id"]] = msg["request_id"]
                elif kind == "error":
                    self.errors.append(msg)
        await asyncio.wait_for(loop(), timeout)

    def text(self, cid: str) -> str:
        return "".join(c["text"] for c in self.chunks[cid])

    def tokens(self, cid: str) -> int:
        return sum(c["tokens"] for c in self.chunks[cid])

    def last_seq(self, cid: str) -> int:
        return self.chunks[cid][-1]["seq"] if self.chunks[cid] else 0

    async def close(self) -> None:
        await self.ws.close()


def assert_seq_increasing(chunks: list[dict]) -> None:
    seqs = [c["seq"] for c in chunks]
    assert seqs == sorted(set(seqs)), f"chunk seqs repeat or go backwards: {seqs}"


def assert_finished_whole(stack: Stack, client: Client, cid: str) -> None:
    """Finished normally, and the client holds exactly the text the workers produced."""
    done = client.done[cid]
    assert done["finish_reason"] in ("stop", "length"), done
    assert_seq_increasing(client.chunks[cid])
    assert done["seq"] == client.last_seq(cid)
    produced, produced_tokens = stack.out_text(client.accepted[cid])
    assert client.text(cid) == produced
    assert client.tokens(cid) == produced_tokens == done["usage"]["completion_tokens"]


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ---------------------------------------------------------------- tests (run in file order)

async def test_requests_complete_through_each_gateway_and_the_proxy(stack):
    urls = [gw["url"] for gw in stack.state["gateways"]] + [stack.state["proxy"]["url"]]
    for i, url in enumerate(urls):
        client = await Client.connect(url)
        try:
            await client.generate(f"r{i}", f"Hello number {i}", 12)
            await client.pump(lambda c: f"r{i}" in c.done, timeout=60)
            assert_finished_whole(stack, client, f"r{i}")
            assert client.tokens(f"r{i}") >= 1
        finally:
            await client.close()


async def test_proxy_forwards_host_so_the_same_origin_page_is_allowed(stack):
    """ALLOWED_ORIGINS lists only another site; the gateway's own page (served through the proxy,
    so Origin carries the proxy's host:port) must still get in, and a foreign origin must not."""
    port = stack.state["proxy"]["port"]
    page = await Client.connect(stack.state["proxy"]["url"], origin=f"http://127.0.0.1:{port}")
    try:
        await page.generate("o", "same origin", 4)
        await page.pump(lambda c: "o" in c.done, timeout=60)
        assert_finished_whole(stack, page, "o")
    finally:
        await page.close()
    foreign = await Client.connect(stack.state["proxy"]["url"], origin="https://evil.example")
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await foreign.pump(lambda c: False, timeout=30)
    assert closed.value.rcvd.code == 1008
    assert [e["code"] for e in foreign.errors] == ["origin_not_allowed"]


async def test_proxy_spreads_sockets_over_both_gateways(stack):
    proxy = stack.state["proxy"]["url"]
    clients = [await Client.connect(proxy) for _ in range(4)]
    try:
        # sockets are open now; each gateway's gauge tells how many it holds
        async with httpx.AsyncClient() as http:
            held = [metric((await http.get(stack.gateway_http(gw) + "/metrics")).text, "gateway_active_sockets")
                    for gw in stack.state["gateways"]]
        assert sum(held) == 4 and all(h >= 1 for h in held), held
        for i, c in enumerate(clients):
            await c.generate("p", f"proxy {i}", 6)
        for c in clients:
            await c.pump(lambda c: "p" in c.done, timeout=60)
            assert_finished_whole(stack, c, "p")
    finally:
        for c in clients:
            await c.close()


async def test_worker_sigterm_mid_stream_finishes_or_hands_back(stack):
    client = await Client.connect(stack.state["gateways"][0]["url"])
    try:
        ids = [f"w{i}" for i in range(4)]
        for cid in ids:
            await client.generate(cid, f"A long story, part {cid}", LONG)
        await client.pump(lambda c: len(c.accepted) == len(ids) and all(c.chunks[i] for i in ids), timeout=60)
        # the worker that owns the first request gets SIGTERM while it is streaming
        owner = stack.redis.hget(stack.keys.meta(client.accepted[ids[0]]), META_OWNER)
        assert owner, "the running request has no owner key"
        victim = next(w for w in stack.state["workers"] if w["worker_id"] == owner.decode())
        assert ids[0] not in client.done, "the request finished before the worker could be interrupted"
        os.kill(victim["pid"], signal.SIGTERM)

        await client.pump(lambda c: all(i in c.done for i in ids), timeout=120)
        for cid in ids:
            assert_finished_whole(stack, client, cid)
        assert _wait_gone(victim["pid"], 40), "the worker did not exit after SIGTERM"
        # with a 0.5 s drain the long requests cannot finish in time: the path under test is the
        # hand-back, visible in the workers' own logs (the other worker continues from the
        # delivered token ids)
        log = stack.log_tail(200_000)
        assert "handed back" in log
        assert any(f"continuing {client.accepted[cid]} after" in log for cid in ids), log[-3000:]
        assert stack.proc.poll() is None, "the stack must keep running with one worker left"

        # the remaining worker serves new work
        await client.generate("after", "after the drain", 8)
        await client.pump(lambda c: "after" in c.done, timeout=60)
        assert_finished_whole(stack, client, "after")
    finally:
        await client.close()


async def test_gateway_sigterm_client_resumes_through_the_proxy(stack):
    client = await Client.connect(stack.state["proxy"]["url"])
    cid = "g1"
    try:
        await client.generate(cid, "Tell me everything", LONG)
        await client.pump(lambda c: len(c.chunks[cid]) >= 2, timeout=60)
        assert cid not in client.done
        # which gateway holds this socket? the one whose gauge shows it (earlier tests' sockets
        # may take a moment to be counted out)
        async with httpx.AsyncClient() as http:
            for _ in range(50):
                held = {gw["name"]: metric((await http.get(stack.gateway_http(gw) + "/metrics")).text,
                                           "gateway_active_sockets") for gw in stack.state["gateways"]}
                if sum(held.values()) == 1:
                    break
                await asyncio.sleep(0.1)
        assert sum(held.values()) == 1, held
        victim = next(gw for gw in stack.state["gateways"] if held[gw["name"]] == 1)
        os.kill(victim["pid"], signal.SIGTERM)

        with pytest.raises(websockets.ConnectionClosed) as closed:
            await client.pump(lambda c: False, timeout=30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012, closed.value
        assert any(e["code"] == "shutting_down" and e["retryable"] for e in client.errors), client.errors
        assert cid not in client.done
        assert _wait_gone(victim["pid"], 30), "the gateway did not exit after SIGTERM"

        # reconnect through the proxy: nginx skips the stopped gateway
        resumed = await Client.connect(stack.state["proxy"]["url"])
        try:
            resumed.accepted[cid] = client.accepted[cid]
            resumed.chunks[cid] = list(client.chunks[cid])
            await resumed.resume(cid, client.last_seq(cid))
            await resumed.pump(lambda c: cid in c.done, timeout=120)
            assert not [e for e in resumed.errors if e.get("id") == cid], resumed.errors
            assert_finished_whole(stack, resumed, cid)
        finally:
            await resumed.close()
    finally:
        await client.close()


def test_stack_sigterm_shuts_everything_down_cleanly(stack):
    pids = [c["pid"] for c in stack.state["gateways"] + stack.state["workers"]] + [stack.state["proxy"]["pid"]]
    redis_port = int(stack.state["redis_url"].rsplit(":", 1)[1].split("/")[0])
    stack.proc.send_signal(signal.SIGTERM)
    rc = stack.proc.wait(90)
    assert rc == 0, stack.log_tail()
    assert not [p for p in pids if _alive(p)]
    assert "stopped cleanly" in stack.log_tail(2000)
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=redis_port, socket_connect_timeout=1).ping()


def test_stack_fails_fast_when_a_worker_cannot_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env.update({"MODEL_PATH": str(tmp_path / "no-such-model"), "DEVICE": "cpu", "STREAM_PREFIX": "topobad"})
    proc = subprocess.run([sys.executable, str(STACK), "--gateways", "1", "--workers", "1", "--gateway-port", "0",
                           "--run-dir", str(tmp_path), "--ready-timeout", "120"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert "worker-0 exited" in proc.stdout and "start-up failed" in proc.stdout
    state = tmp_path / "stack.json"
    assert not state.exists(), "a failed start must not publish a state file"


def test_stack_uses_an_external_redis_and_leaves_it_running(tmp_path, redis_server, tiny_model_dir):
    """With REDIS_URL set (compose, managed Redis) the stack starts no Redis of its own, serves
    through the given one, and its shutdown does not touch it."""
    prefix = f"topoext{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "REDIS_URL": redis_server.url, "STREAM_PREFIX": prefix, "MODEL_PATH": str(tiny_model_dir),
           "DEVICE": "cpu", "TORCH_THREADS": "1"}
    state_file = tmp_path / "stack.json"
    log = tmp_path / "stack.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(STACK), "--gateway-port", "0", "--run-dir", str(tmp_path),
                                 "--state-file", str(state_file), "--ready-timeout", "120"],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while not state_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        state = json.loads(state_file.read_text())
        assert state["redis_url"] == redis_server.url
        assert not (tmp_path / "redis").exists(), "no embedded Redis when REDIS_URL is given"
        client = redis.Redis.from_url(redis_server.url)
        try:
            assert client.exists(Keys(prefix).worker(state["workers"][0]["worker_id"]))
        finally:
            client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(90)
    assert rc == 0, log.read_text()[-4000:]
    assert redis.Redis.from_url(redis_server.url).ping()
