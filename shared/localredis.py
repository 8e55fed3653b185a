"""Start and stop a private `redis-server` process (tests, benches, the embedded dev stack).

Tests own their server so they can kill it, restart it on the same port (with AOF, to check
nothing acknowledged is lost) and never touch a Redis someone else uses.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedis:
    def __init__(self, port: int | None = None, *, appendonly: bool = False, data_dir: str | None = None,
                 extra_args: list[str] | None = None):
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: install Debian's redis-server package (scripts/setup.sh does)")
        self.binary = binary
        self.port = port or free_port()
        self.appendonly = appendonly
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="llm-redis-")
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "LocalRedis":
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
            "--dir", self.data_dir, "--daemonize", "no", "--loglevel", "warning", *self.extra_args,
        ]
        log = open(Path(self.data_dir) / "redis.log", "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.data_dir}/redis.log")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self, *, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self, *, kill: bool = False, down_for: float = 0.0) -> None:
        self.stop(kill=kill)
        time.sleep(down_for)
        self.start()

    def __enter__(self) -> "LocalRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def free_cluster_port() -> int:
    """A port whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        port = random.randint(20000, 29999)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


class LocalRedisCluster:
    """`nodes` masters (no replicas) with `redis-server --cluster-enabled yes`, joined by
    `redis-cli --cluster create`: a real Redis Cluster for tests and benches."""

    def __init__(self, nodes: int = 3):
        if shutil.which("redis-cli") is None:
            raise RuntimeError("redis-cli not found: install Debian's redis-tools package")
        self.nodes: list[LocalRedis] = []
        for _ in range(nodes):
            data_dir = tempfile.mkdtemp(prefix="llm-redis-cluster-")
            self.nodes.append(LocalRedis(free_cluster_port(), data_dir=data_dir, extra_args=[
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"]))

    @property
    def url(self) -> str:
        """The service's REDIS_URL for this cluster (any node is a seed)."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self, timeout: float = 30.0) -> "LocalRedisCluster":
        for node in self.nodes:
            node.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(["redis-cli", "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [subprocess.run(["redis-cli", "-p", str(n.port), "cluster", "info"], capture_output=True,
                                     text=True).stdout for n in self.nodes]
            if all("cluster_state:ok" in s and "cluster_slots_assigned:16384" in s for s in states):
                return self
            time.sleep(0.1)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> "LocalRedisCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":  # python -m shared.localredis [port]: a foreground server for the dev stack
    import sys
    port = int(sys.argv[1]) if len(sys.argv) > 1 else int(os.environ.get("REDIS_PORT", "6379"))
    server = LocalRedis(port, appendonly=True, data_dir=os.environ.get("REDIS_DIR") or None).start()
    print(f"redis-server on {server.url} (data in {server.data_dir})", flush=True)
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        server.stop()
