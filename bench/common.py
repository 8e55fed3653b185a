"""Helpers shared by the bench scripts: percentiles, a plain-text table, JSON results, client
threads, llama.cpp's streaming API."""

from __future__ import annotations

import json
import math
import platform
import threading
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "out"  # gitignored


def percentile(values, p: float) -> float:
    """Nearest-rank-with-interpolation percentile (p in 0..100); nan for no values."""
    data = sorted(values)
    if not data:
        return math.nan
    k = (len(data) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return data[lo] + (data[hi] - data[lo]) * (k - lo)


def table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda parts: "| " + " | ".join(p.ljust(w) for p, w in zip(parts, widths)) + " |"
    out = [line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(row) for row in cells]
    return "\n".join(out)


def machine() -> dict:
    import os
    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}


def write_json(name: str, data: dict) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {"bench": name, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(), **data}
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def run_threads(target, items) -> None:
    """`target(item)` on a thread of its own for each item (blocking clients, e.g. of llama.cpp's
    server, all at once); when they have all ended, re-raise the first exception any of them hit."""
    errors: list[Exception] = []

    def guarded(item) -> None:
        try:
            target(item)
        except Exception as exc:   # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(item,), daemon=True) for item in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def llamacpp_events(url: str, body: dict):
    """Stream llama.cpp's server `/completion` (body with "stream": true): its events, parsed, up
    to and including the one with "stop"."""
    import http.client
    import urllib.parse
    target = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(target.hostname, target.port or 80, timeout=600)
    try:
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            yield event
            if event.get("stop"):
                return
    finally:
        conn.close()
