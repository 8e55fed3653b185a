"""A small WebSocket client for gateway tests and benches: sends dicts, demultiplexes replies by id."""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict, deque

import msgpack
import websockets


class GatewayClient:
    def __init__(self, ws, *, binary: bool = False):
        self.ws = ws
        self.binary = binary
        self.pending: dict[str | None, deque] = defaultdict(deque)
        self.arrivals: dict[str, list[float]] = defaultdict(list)

    @classmethod
    async def connect(cls, url: str, *, binary: bool = False, headers: dict | None = None, **kwargs) -> "GatewayClient":
        proto = "llm-stream.msgpack" if binary else "llm-stream.json"
        ws = await websockets.connect(url, subprotocols=[proto], additional_headers=headers, **kwargs)
        return cls(ws, binary=binary)

    async def send(self, **msg) -> None:
        await self.ws.send(msgpack.packb(msg) if self.binary else json.dumps(msg))

    async def recv_any(self, timeout: float = 10.0) -> dict:
        raw = await asyncio.wait_for(self.ws.recv(), timeout)
        msg = msgpack.unpackb(raw) if isinstance(raw, bytes) else json.loads(raw)
        if msg.get("type") == "chunk":
            self.arrivals[msg["id"]].append(time.monotonic())
        return msg

    async def recv(self, id: str | None = None, timeout: float = 10.0, skip=("heartbeat",)) -> dict:
        """Next message for `id` (messages for other ids are kept for later)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.pending[id]:
                return self.pending[id].popleft()
            msg = await self.recv_any(max(0.01, deadline - time.monotonic()))
            if msg.get("type") in skip:
                continue
            self.pending[msg.get("id")].append(msg)

    async def until_done(self, id: str, timeout: float = 60.0) -> tuple[list[dict], dict]:
        """Chunks of `id` until its `done` (or a refusing `error`, returned as the second item)."""
        chunks = []
        deadline = time.monotonic() + timeout
        while True:
            msg = await self.recv(id, timeout=max(0.01, deadline - time.monotonic()))
            if msg["type"] == "chunk":
                chunks.append(msg)
            elif msg["type"] in ("done", "error"):
                return chunks, msg

    async def close(self) -> None:
        await self.ws.close()
