"""Reusable process fixtures: start a worker or gateway (subprocess or in-process) and wait for it.

Used by the gateway, worker, topology and bench code so that every test drives the real
processes the same way. Each helper returns something that stops cleanly and never leaves a
child behind (children run in their own session and are killed by pid on exit).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Iterator

from shared.localredis import free_port
from shared.redis_client import connect_sync

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def _env(redis_url: str, prefix: str, extra: dict | None) -> dict:
    env = dict(os.environ)
    # many workers share this host in tests: no metrics port unless a test asks for one
    env.update({"REDIS_URL": redis_url, "STREAM_PREFIX": prefix, "PYTHONUNBUFFERED": "1", "WORKER_METRICS_PORT": "0"})
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


class Proc:
    """A child process with its log file; `stop()` sends SIGTERM, then SIGKILL after `grace`."""

    def __init__(self, popen: subprocess.Popen, log_path: Path, metrics_url: str | None = None):
        self.popen = popen
        self.log_path = log_path
        self.metrics_url = metrics_url      # its /metrics, where it serves one (start_worker(metrics=True))

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace`; a process that needed the SIGKILL is asked for its
        threads' stacks first (SIGUSR1: python -m worker dumps them) and its log tail is printed,
        so a failing test says where the stop hung."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.send_signal(signal.SIGUSR1)
                    self.popen.wait(1.0)
                if self.popen.poll() is None:
                    self.popen.kill()
                    self.popen.wait()
                print(f"\n{self.log_path.name}: no exit within {grace} s of SIGTERM, killed; its log ends:\n"
                      f"{self.log()[-6000:]}")
        return self.popen.returncode


def engine_pids(pid: int) -> list[int]:
    """Live (not zombie) engine processes of worker `pid`: its children started by
    multiprocessing's spawn (not its resource tracker, which spawn also starts)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[1]) == pid and b"spawn_main" in cmdline:
            found.append(int(stat.parent.name))
    return found


def pid_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def spawn(module: str, env: dict, log_dir: Path, name: str, args: tuple[str, ...] = ()) -> Proc:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    out = open(log_path, "ab")
    popen = subprocess.Popen([PYTHON, "-m", module, *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
    port = env.get("WORKER_METRICS_PORT", "0") if module.startswith("worker") else "0"
    return Proc(popen, log_path, f"http://127.0.0.1:{port}/metrics" if port != "0" else None)


def wait_for_worker(redis_url: str, prefix: str, proc: Proc, *, count: int = 1, timeout: float = 120.0) -> None:
    """A worker is ready once it is in the registry zset `p:{reg}:workers`."""
    from shared.streams import Keys
    client = connect_sync(redis_url)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"worker exited with {proc.popen.returncode}:\n{proc.log()[-4000:]}")
            if client.zcard(Keys(prefix).workers) >= count:
                return
            time.sleep(0.1)
    finally:
        client.close()
    raise RuntimeError(f"worker not registered after {timeout}s:\n{proc.log()[-4000:]}")


def start_worker(redis_url: str, prefix: str, model_dir: str | os.PathLike, log_dir: Path, *,
                 name: str = "worker", env: dict | None = None, wait: bool = True, metrics: bool = False) -> Proc:
    """`python -m worker` on the given model directory (tiny model in tests); `metrics`: it serves
    /metrics (`scrape(proc)`)."""
    extra = {"MODEL_PATH": str(model_dir), "DEVICE": "cpu", "TORCH_THREADS": "1", "WORKER_ID": name}
    if metrics:
        extra["WORKER_METRICS_PORT"] = free_port()
    extra.update(env or {})
    return _registered(redis_url, prefix, spawn("worker", _env(redis_url, prefix, extra), log_dir, name), wait)


def _registered(redis_url: str, prefix: str, proc: Proc, wait: bool) -> Proc:
    """`proc`, once it is in the registry where `wait` (stopped if it never gets there)."""
    if wait:
        try:
            wait_for_worker(redis_url, prefix, proc)
        except Exception:
            proc.stop(grace=2)
            raise
    return proc


def start_workers(redis_url: str, prefix: str, model_dir: str | os.PathLike | None, log_dir: Path, names, *,
                  env: dict | None = None, metrics: bool = False, step_ms: float = 5.0,
                  max_batch: int = 8) -> list[Proc]:
    """Workers `names` started side by side, once all of them are registered: `start_worker` on
    `model_dir`, or `start_synthetic_worker` (`step_ms`, `max_batch`) where it is None."""
    if model_dir is None:
        procs = [start_synthetic_worker(redis_url, prefix, log_dir, name=name, env=env, step_ms=step_ms,
                                        max_batch=max_batch, wait=False) for name in names]
    else:
        procs = [start_worker(redis_url, prefix, model_dir, log_dir, name=name, env=env, wait=False, metrics=metrics)
                 for name in names]
    try:
        for proc in procs:
            wait_for_worker(redis_url, prefix, proc, count=len(procs))
    except Exception:
        for proc in procs:
            proc.stop(grace=2)
        raise
    return procs


def wait_http_ok(url: str, proc: Proc | None = None, timeout: float = 30.0) -> None:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"process exited with {proc.popen.returncode}:\n{proc.log()[-4000:]}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout}s" + (f":\n{proc.log()[-4000:]}" if proc else ""))


def start_gateway(redis_url: str, prefix: str, log_dir: Path, *, port: int | None = None, name: str = "gateway",
                  env: dict | None = None) -> tuple[Proc, str]:
    """`python -m gateway` as a subprocess; returns (proc, "http://127.0.0.1:port")."""
    port = port or free_port()
    extra = {"GATEWAY_HOST": "127.0.0.1", "GATEWAY_PORT": port}
    extra.update(env or {})
    proc = spawn("gateway", _env(redis_url, prefix, extra), log_dir, name)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(base + "/readyz", proc)
    except Exception:
        proc.stop(grace=2)
        raise
    return proc, base


def gateway_settings(redis_url: str, prefix: str, **overrides):
    """Settings of a test gateway on `prefix`: no heartbeats and no ping timeout (tests that
    need them say so), the rest as given."""
    from gateway.settings import GatewaySettings
    return GatewaySettings(**{"redis_url": redis_url, "stream_prefix": prefix, "heartbeat_s": 0, "ping_timeout_s": 0,
                              **overrides})


@dataclass
class StackSpec:
    """A test module's stack (`STACK = StackSpec(...)` in the module; its tests take the
    `stack` and `make_settings` fixtures of tests/conftest.py): one worker on a fresh key prefix,
    `python -m worker` on the tiny model or the synthetic engine (`synthetic=True`: the real
    service, no model), and the gateway settings its tests start from."""
    name: str                                           # the worker's id (and the prefix's start)
    env: dict = field(default_factory=dict)             # the worker's
    gateway: dict = field(default_factory=dict)         # gateway_settings overrides for every test
    synthetic: bool = False
    step_ms: float = 5.0                                # synthetic engine only
    max_batch: int = 64                                 # synthetic engine only (env MAX_BATCH otherwise)


@dataclass
class Stack:
    redis_url: str
    prefix: str
    worker: Proc
    gateway: dict

    @property
    def keys(self):
        from shared.streams import Keys
        return Keys(self.prefix)

    def settings(self, **overrides):
        """Settings of a gateway on this stack: the spec's, then `overrides`."""
        return gateway_settings(self.redis_url, self.prefix, **{**self.gateway, **overrides})


@contextlib.contextmanager
def worker_stack(redis_url: str, spec: StackSpec, log_dir: Path, model_dir: str | os.PathLike | None = None
                 ) -> Iterator[Stack]:
    """The one way tests start a gateway+worker stack: `spec`'s worker on a fresh prefix."""
    prefix = f"{spec.name.replace('-', '')}{uuid.uuid4().hex[:8]}"
    if spec.synthetic:
        proc = start_synthetic_worker(redis_url, prefix, log_dir, name=spec.name, env=spec.env, step_ms=spec.step_ms,
                                      max_batch=spec.max_batch)
    else:
        proc = start_worker(redis_url, prefix, model_dir, log_dir, name=spec.name, env=spec.env)
    try:
        yield Stack(redis_url, prefix, proc, spec.gateway)
    finally:
        proc.stop()


@contextlib.contextmanager
def prefix_with_worker(redis_url: str, model_dir: str | os.PathLike, log_dir: Path, *, name: str,
                       env: dict | None = None) -> Iterator[str]:
    """A fresh key prefix served by one worker on the tiny model; yields the prefix."""
    with worker_stack(redis_url, StackSpec(name, env or {}), log_dir, model_dir) as stack:
        yield stack.prefix


@contextlib.contextmanager
def worker_process(*args, **kwargs) -> Iterator[Proc]:
    proc = start_worker(*args, **kwargs)
    try:
        yield proc
    finally:
        proc.stop()


class InProcessGateway:
    """The gateway app served by uvicorn inside the test's event loop (fast to start, easy to inspect)."""

    def __init__(self, settings):
        from gateway.app import create_app
        from gateway.server import GatewayServer, build_config
        self.settings = settings
        self.port = free_port()
        self.app = create_app(settings)
        config = build_config(settings, self.app, port=self.port)
        self.server = GatewayServer(config)
        self.task: asyncio.Task | None = None

    @property
    def probe(self):
        """The gateway's documented window for tests and operations (gateway.probe.GatewayProbe):
        counts, /metrics samples, drain(), routing's worker snapshot, fault injection. Tests use
        it (or the public API) and never the gateway's parts; it exists once the gateway started."""
        return self.app.state.probe

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"

    async def start(self) -> "InProcessGateway":
        self.server.config.setup_event_loop = lambda: None
        self.server.install_signal_handlers = lambda: None  # older uvicorn
        self.task = asyncio.get_running_loop().create_task(self.server.serve())
        deadline = time.monotonic() + 20
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise RuntimeError("gateway server stopped during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError("gateway did not start")
            await asyncio.sleep(0.02)
        return self

    async def stop(self) -> None:
        if self.task is None:
            return
        self.server.should_exit = True
        done, _ = await asyncio.wait({self.task}, timeout=30)
        task, self.task = self.task, None
        if not done:  # a gateway that does not stop is a bug: say where every task is stuck
            stacks = io.StringIO()
            for other in asyncio.all_tasks():
                if other is not asyncio.current_task():
                    other.print_stack(limit=12, file=stacks)
            self.server.force_exit = True
            task.cancel()
            raise AssertionError(f"the in-process gateway did not stop within 30 s; tasks:\n{stacks.getvalue()}")
        task.result()


@contextlib.asynccontextmanager
async def gateway_in_process(settings) -> AsyncIterator[InProcessGateway]:
    gw = await InProcessGateway(settings).start()
    try:
        yield gw
    finally:
        await gw.stop()


def start_synthetic_worker(redis_url: str, prefix: str, log_dir: Path, *, name: str, env: dict | None = None,
                           step_ms: float = 5.0, max_batch: int = 8, wait: bool = True) -> Proc:
    """`python -m worker.synthetic`: the real worker service around a GPU-paced fake engine (no
    model, starts in about a second); for faults that are about Redis and ownership."""
    proc = spawn("worker.synthetic", _env(redis_url, prefix, {"WORKER_ID": name, **(env or {})}), log_dir, name,
                 args=("--step-ms", str(step_ms), "--max-batch", str(max_batch)))
    return _registered(redis_url, prefix, proc, wait)


def metric_samples(text: str) -> dict[tuple, float]:
    """{(sample name, sorted label items): value} of a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(found: dict, name: str, **labels) -> float:
    """One sample of `metric_samples`' result (0 when absent)."""
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


async def scrape(target: Proc | str) -> dict[tuple, float]:
    """The `metric_samples` of a worker started with metrics=True, or of a /metrics URL."""
    import httpx
    url = target if isinstance(target, str) else target.metrics_url
    assert url, "start the worker with metrics=True"
    async with httpx.AsyncClient(timeout=10) as http:
        return metric_samples((await http.get(url)).text)
