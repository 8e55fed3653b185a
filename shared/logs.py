"""One logging set-up for every process (gateway, worker, engine process): LOG_LEVEL, and
LOG_FORMAT=text (default) or json (one JSON object per line, for Loki/ELK).

Why its own module: a request is followed across processes by its id, so every log line about
a request carries it in the same field, `rid` (`log.info(..., extra=rid_of(rid))`); the text
format appends it as ` rid=<id>`, the JSON format makes it a key. JSON lines come from
python-json-logger (well kept, stdlib `logging` underneath): `ts`, `level`, `logger`,
`message`, `process` (gateway | worker | engine), `pid`, and `rid` and other extras when given.
A dict logged as the message (`log.info({"message": ..., "rid": ..., ...})`, the gateway's
per-request line) puts its fields at the top of the JSON object, or as `key=value` after the
message in the text format.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from pythonjsonlogger.json import JsonFormatter

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def rid_of(rid: str | None) -> dict:
    """The `extra` of a log call about request `rid`."""
    return {"rid": rid} if rid else {}


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        if isinstance(record.msg, dict):     # a record of fields (the per-request line)
            record = logging.makeLogRecord({**record.__dict__, "msg": fields_text(record.msg), "args": None})
        line = super().format(record)
        rid = getattr(record, "rid", None)
        return f"{line} rid={rid}" if rid else line


def fields_text(fields: dict) -> str:
    """A dict logged as a message, in the text format: its `message`, then `key=value` for
    every other field that has a value (in JSON each field is a key of the line's object)."""
    rest = " ".join(f"{k}={v}" for k, v in fields.items() if k != "message" and v is not None)
    return f"{fields.get('message', '')} {rest}".strip()


# the JSON line's own keys: LogRecord attribute -> key
JSON_KEYS = {"asctime": "ts", "levelname": "level", "name": "logger", "service": "process", "process": "pid"}


class _JsonFormatter(JsonFormatter):
    """python-json-logger's formatter, with a short path for a dict message (one record of
    fields, e.g. the per-request line): its keys go straight into the object after the line's
    own keys, one json.dumps, instead of python-json-logger's rename lookup per key (a third of
    the line's cost at ~25 fields; bench/request_log.py)."""

    def format(self, record: logging.LogRecord) -> str:
        if not isinstance(record.msg, dict) or record.exc_info or record.stack_info:
            return super().format(record)
        line = {"ts": self.formatTime(record, self.datefmt), "level": record.levelname, "logger": record.name,
                "process": getattr(record, "service", None), "pid": record.process}
        line.update(record.msg)
        return json.dumps(line, default=str, ensure_ascii=False)


class _ProcessFilter(logging.Filter):
    def __init__(self, process: str):
        super().__init__()
        self.process_name = process

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.process_name
        return True


def configure(process: str, *, level: str | None = None, fmt: str | None = None, stream=None) -> None:
    """Set up the root logger for this process (replacing what was there)."""
    level = (level or os.environ.get("LOG_LEVEL") or "INFO").upper()
    fmt = (fmt or os.environ.get("LOG_FORMAT") or "text").lower()
    handler = logging.StreamHandler(stream or sys.stdout)
    if fmt == "json":
        # progress bars (transformers loading weights) are not log lines: keep stdout one object a line
        # (read by tqdm when it is first imported: the worker sets them before that, worker.__main__)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")
        handler.setFormatter(_JsonFormatter("%(asctime)s %(levelname)s %(name)s %(service)s %(process)d %(message)s",
                                            rename_fields=JSON_KEYS))
    else:
        handler.setFormatter(_TextFormatter(TEXT_FORMAT))
    handler.addFilter(_ProcessFilter(process))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
