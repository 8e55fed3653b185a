"""What typed events cost the gateway: decoding inbox entries of token events into dicts (the
wire maps, as the gateway read them before shared.events) versus into `TokEvent`s, alone and
with the reads the gateway's sites make of each event (inbox: rid; join: epoch, seq, first
token; request table: prompt size, text, n, seq, logprobs).

    .venv/bin/python bench/events_decode.py [--events 10000] [--per-entry 64] [--repeats 5]

The variants run interleaved; the table gives each one's best repeat (the least disturbed by
other work on the machine), in ms per `events` and ns per event.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import table  # noqa: E402
from shared.events import TokEvent, decode_events  # noqa: E402
from shared.streams import decode_event_list, pack_event_list  # noqa: E402


def entries(events: int, per_entry: int, lens: bool = False) -> list[bytes]:
    """`lens`: the events carry per-token text lengths (`tl`, what a resume inside one cuts by)."""
    payloads = [TokEvent(f"{i:032x}", 40 + i % 7, [1000 + i, 2000 + i, 3000 + i], " the", 1,
                         1_700_000_000_000 + i, None, 120, [2, 0, 2] if lens else None).encode() for i in range(events)]
    return [pack_event_list(payloads[i:i + per_entry]) for i in range(0, events, per_entry)]


def variants(batches: list[bytes], with_lens: list[bytes]) -> dict:
    def dicts() -> None:
        for b in batches:
            decode_event_list(b)

    def typed() -> None:
        for b in batches:
            decode_events(b)

    def typed_lens() -> None:
        for b in with_lens:
            decode_events(b)

    def dicts_read() -> None:       # the reads as the sites made them before (gateway/*.py at main~)
        for b in batches:
            for ev in decode_event_list(b):
                if not isinstance(ev, dict):
                    continue
                ev.get("rid")
                if ev.get("k") == "tok":
                    int(ev.get("ep") or 0)
                    int(ev.get("seq") or 0) - int(ev.get("n") or 0) + 1
                    ev.get("pt"), ev.get("text") or "", int(ev.get("n") or 0), int(ev["seq"]), ev.get("lp")

    def typed_read() -> None:
        for b in batches:
            for ev in decode_events(b):
                ev.rid
                if isinstance(ev, TokEvent):
                    ev.epoch
                    ev.seq - len(ev.ids) + 1
                    ev.prompt_tokens, ev.text, len(ev.ids), ev.seq, ev.logprobs

    return {"dict decode": dicts, "typed decode": typed, "typed decode, with tl": typed_lens,
            "dict decode + reads": dicts_read,
            "typed decode + reads": typed_read}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=10_000)
    ap.add_argument("--per-entry", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    runs = variants(entries(args.events, args.per_entry), entries(args.events, args.per_entry, lens=True))
    best = {name: float("inf") for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            best[name] = min(best[name], min(timeit.repeat(fn, number=3, repeat=3)) / 3)
    print(table([{"variant": name, "ms": round(t * 1e3, 2), "ns_per_event": round(t * 1e9 / args.events)}
                 for name, t in best.items()], ["variant", "ms", "ns_per_event"]))


if __name__ == "__main__":
    main()
