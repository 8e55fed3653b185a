"""Container health checks (Docker HEALTHCHECK / compose `healthcheck:`), one per process kind.

Exit 0 = healthy, 1 = unhealthy, with one line on stdout saying why (Docker keeps it in
`docker inspect`). Both read the same environment settings as the process they check.

- gateway: GET /readyz on the local port; the gateway answers 200 only while it can reach
  Redis and is not draining, so the proxy and orchestrators stop routing to it.
- worker: the worker has no HTTP port. Its liveness signal is the registry entry it refreshes
  every WORKER_HEARTBEAT_S with a TTL of WORKER_TTL_S (`{prefix}:{w:<id>}:info`, shared/streams.py):
  if the engine thread or the Redis loop is stuck, the entry expires and the check fails; an
  engine whose every step fails (e.g. a poisoned CUDA context) marks the entry
  `state: unhealthy` with the `reason`, takes no more work, and the check fails too. The
  container's WORKER_ID defaults to its hostname (see deploy/worker.Dockerfile) so the check
  knows which entry is its own.

Usage: python healthcheck.py gateway|worker
"""

from __future__ import annotations

import socket
import sys
import urllib.request


def check_gateway() -> tuple[bool, str]:
    from shared.config import Settings

    settings = Settings()
    host = "127.0.0.1" if settings.gateway_host in ("0.0.0.0", "::", "") else settings.gateway_host
    url = f"http://{host}:{settings.gateway_port}/readyz"
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return resp.status == 200, f"{url} -> {resp.status}"
    except Exception as exc:  # HTTPError (503 while draining), connection refused, timeout
        return False, f"{url} -> {exc}"


def check_worker() -> tuple[bool, str]:
    import redis

    from shared.config import Settings
    from shared.streams import Keys

    settings = Settings()
    worker_id = settings.worker_id or socket.gethostname()
    key = Keys(settings.stream_prefix).worker(worker_id)
    try:
        client = redis.Redis.from_url(settings.redis_url, socket_timeout=3, socket_connect_timeout=3)
        info = {k.decode(): v.decode() for k, v in client.hgetall(key).items()}
    except Exception as exc:
        return False, f"redis unreachable: {exc}"
    if not info:
        return False, f"registry entry {key} missing (heartbeat stale)"
    if info.get("state") == "unhealthy":
        return False, f"engine unhealthy: {info.get('reason', '')}"
    return True, f"registry entry {key} present ({info.get('state', '')})"


def main(argv: list[str]) -> int:
    checks = {"gateway": check_gateway, "worker": check_worker}
    if len(argv) != 2 or argv[1] not in checks:
        print(__doc__.strip().splitlines()[-1])
        return 2
    ok, why = checks[argv[1]]()
    print(("healthy: " if ok else "unhealthy: ") + why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
