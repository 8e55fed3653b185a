"""The docs can be checked, so they are: every Redis key the operator docs name is one the code
really uses (shared/streams.py `Keys`), and every example frame of docs/protocol.md is one the
gateway parses and accepts (client frames) or could send (server frames)."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

from gateway.settings import GatewaySettings
from shared.protocol import Generate, decode_frame, parse_client_message, parse_server_message
from shared.streams import Keys

DOCS = Path(__file__).resolve().parent.parent / "docs"
KEY_IN_DOCS = re.compile(r"`?(p:\{[^}`\s]*\}:[A-Za-z_<>:|-]+)")


def key_templates() -> set[str]:
    """Every key `Keys` produces, with each argument shown as `<>`."""
    keys = Keys("p")
    out = set()
    for name, member in inspect.getmembers(Keys):
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            out.add(getattr(keys, name))
        elif inspect.isfunction(member):
            params = list(inspect.signature(member).parameters)[1:]
            out.add(getattr(keys, name)(*["<>"] * len(params)))
    return out


def normalize(doc_key: str) -> list[str]:
    """`p:{r:<rid>}:out|meta` -> ["p:{r:<>}:out", "p:{r:<>}:meta"]; an example name in a tag
    (`p:{g:g}:inbox`) stands for any."""
    key = re.sub(r"<[^>]*>", "<>", doc_key.rstrip(":"))
    key = re.sub(r"\{(\w+):[^}]*\}", r"{\1:<>}", key)
    head, _, tail = key.rpartition(":")
    return [f"{head}:{alt}" for alt in tail.split("|")] if "|" in tail else [key]


@pytest.mark.parametrize("doc", ["operations.md", "failover.md", "transport.md"])
def test_every_redis_key_the_docs_name_is_a_real_one(doc):
    text = (DOCS / doc).read_text()
    assert "{p}:" not in text, "keys are written p:{tag}:name (p = STREAM_PREFIX)"
    real = key_templates()
    named = [k for m in KEY_IN_DOCS.finditer(text) for k in normalize(m.group(1))]
    assert named, f"{doc} names no key?"
    unknown = sorted({k for k in named if k not in real})
    assert not unknown, f"{doc} names keys the code never uses: {unknown}; real ones: {sorted(real)}"


def protocol_examples() -> tuple[list[dict], list[dict]]:
    """(client frames, server frames) shown in docs/protocol.md: the `>`/`<` lines of the example
    sessions and the inline `{"type": ...}` objects."""
    text = (DOCS / "protocol.md").read_text()
    client, server = [], []
    for line in text.splitlines():
        if line.startswith("> {"):
            client.append(json.loads(line[2:]))
        elif line.startswith("< {"):
            server.append(json.loads(line[2:]))
    for inline in re.findall(r"`(\{\"type\"[^`]*\})`", text):
        obj = json.loads(inline)
        (server if obj["type"] in ("pong", "error", "accepted", "chunk", "done", "heartbeat") else client).append(obj)
    return client, server


def test_every_example_frame_in_the_protocol_docs_is_accepted():
    client, server = protocol_examples()
    assert len(client) >= 8 and len(server) >= 10
    caps = GatewaySettings()
    for obj in client:
        msg = parse_client_message(decode_frame(json.dumps(obj), max_bytes=caps.max_frame_bytes))
        if isinstance(msg, Generate):      # and within the server's default caps
            assert (msg.max_tokens or 0) <= caps.max_tokens_cap and msg.prompt_chars() <= caps.max_prompt_chars
            assert len(msg.stop) <= caps.max_stop_strings
    for obj in server:
        parse_server_message(obj)
