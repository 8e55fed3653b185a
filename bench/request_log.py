"""What the gateway's per-request log line costs (gateway.request_log): the time one
`log_finished` call takes, from building its fields to the formatted line written out, in each
LOG_FORMAT, and with INFO off (the call only tests the level).

One finished request, as the gateway holds it when its `done` goes out: a RequestState with
its timings and a worker's final event (usage, worker, lane, the worker's timings). The line
is written to /dev/null through the same handler shared.logs.configure installs, so the figure
is the process's CPU per line, without a terminal or a collector behind it. The baseline, in
the same run: a one-field line like the gateway's other per-request lines (its DEBUG `done`).

    .venv/bin/python bench/request_log.py [--lines 10000] [--repeats 9]

Each variant runs `lines` calls per repeat, the variants interleaved; the table gives the median
and the minimum of the repeats' per-call means (the minimum is the least disturbed by other
work on the machine).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import table, write_json  # noqa: E402
from gateway.flusher import ChunkBuffer  # noqa: E402
from gateway.request_log import log_finished  # noqa: E402
from gateway.request_state import RequestState  # noqa: E402
from shared.events import DoneEvent, DoneUsage  # noqa: E402
from shared.logs import configure, rid_of  # noqa: E402


def finished_request() -> tuple[RequestState, DoneEvent]:
    req = RequestState("chat-1", "f6ef3e429cff2cf71041d7f1afadf500", "key:bd67a06e770d62ce", ChunkBuffer(0.04, 24))
    t = req.started
    req.first_sent, req.meaningful_at, req.last_sent, req.seq = t + 0.21, t + 0.25, t + 3.9, 212
    final = DoneEvent(req.rid, 212, "stop", DoneUsage(prompt_tokens=512, completion_tokens=212, cached_tokens=448,
                                                     ttft_ms=180, ttfmt_ms=214, ttlt_ms=3870),
                      epoch=1, ms=0, worker="worker-7f3c", lane="interactive")
    return req, final


def per_line_us(lines: int, plain: bool = False) -> float:
    """Mean µs per log_finished call over `lines` calls (`plain`: per one-field line like the
    gateway's other request lines, the baseline)."""
    req, final = finished_request()
    other = logging.getLogger("gateway.connection")
    start = time.perf_counter()
    if plain:
        for _ in range(lines):
            other.info("request %s done on this gateway (%s): %s, seq %d", req.rid, req.client_id, "stop", 212,
                       extra=rid_of(req.rid))
    else:
        for _ in range(lines):
            log_finished(req, final)
    return (time.perf_counter() - start) / lines * 1e6


VARIANTS = (("request line", "json", "INFO"), ("plain line", "json", "INFO"), ("request line", "text", "INFO"),
            ("plain line", "text", "INFO"), ("request line", "json", "WARNING"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lines", type=int, default=10000)
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    runs: dict[tuple, list[float]] = {v: [] for v in VARIANTS}
    with open(os.devnull, "w") as sink:
        for _ in range(args.repeats):        # the variants interleaved: a noisy neighbour hits them alike
            for line, fmt, level in VARIANTS:
                configure("gateway", level=level, fmt=fmt, stream=sink)
                runs[(line, fmt, level)].append(per_line_us(args.lines, plain=line == "plain line"))
    rows = []
    for (line, fmt, level), us in runs.items():
        rows.append({"line": line, "format": fmt, "level": level, "us_median": statistics.median(us),
                     "us_min": min(us), "lines_per_core_s": 1e6 / min(us) if level == "INFO" else ""})
    logging.getLogger().handlers.clear()
    print(table(rows, ["line", "format", "level", "us_median", "us_min", "lines_per_core_s"]))
    path = write_json("request_log", {"lines": args.lines, "repeats": args.repeats, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
