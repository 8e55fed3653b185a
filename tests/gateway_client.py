"""A small WebSocket client for gateway tests and benches: sends dicts, demultiplexes replies by id."""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
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

    async def send_generate(self, id: str, *, timeout: float = 30.0, **params) -> dict:
        """Send `generate` (greedy on "Once upon a time" unless `params` say otherwise); its first
        reply: `accepted`, or the error refusing it."""
        params.setdefault("prompt", "Once upon a time")
        params.setdefault("temperature", 0.0)
        await self.send(type="generate", id=id, **params)
        return await self.recv(id, timeout=timeout)

    async def generate(self, id: str, *, timeout: float = 30.0, **params) -> str:
        """`send_generate`, and expect it `accepted`: the request id."""
        reply = await self.send_generate(id, timeout=timeout, **params)
        assert reply["type"] == "accepted", reply
        return reply["request_id"]

    async def chunks(self, id: str, tokens: int, timeout: float = 30.0) -> list[dict]:
        """Chunks of `id` until they hold at least `tokens` tokens (anything else fails)."""
        seen: list[dict] = []
        while sum(ch["tokens"] for ch in seen) < tokens:
            msg = await self.recv(id, timeout=timeout)
            assert msg["type"] == "chunk", msg
            seen.append(msg)
        return seen

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


async def eventually(predicate, timeout: float = 5.0, interval: float = 0.02) -> bool:
    """Poll `predicate()` (a plain or an async function) until it is true or `timeout` passes;
    its last value."""
    async def value() -> bool:
        result = predicate()
        return bool(await result if inspect.isawaitable(result) else result)

    deadline = time.monotonic() + timeout
    while not await value():
        if time.monotonic() > deadline:
            return await value()
        await asyncio.sleep(interval)
    return True


# ---------------------------------------------------------------- a raw socket (blocking; use in a thread)

def open_raw_socket(host: str, port: int, *, rcvbuf: int | None = None, path: str = "/v1/stream",
                    timeout: float = 10.0) -> socket.socket:
    """A WebSocket handshake on a plain TCP socket whose receive buffer can be made small, for
    clients that stop reading. The caller writes frames with `masked_frame` and reads nothing."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)   # before connect: sets the window
    sock.settimeout(timeout)
    sock.connect((host, port))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        if not chunk:
            raise ConnectionError("closed during the handshake")
        head += chunk
    if b" 101 " not in head.split(b"\r\n")[0]:
        raise ConnectionError(head.decode(errors="replace"))
    return sock


def masked_frame(payload: bytes, opcode: int = 0x1) -> bytes:
    """One client frame (clients must mask), FIN set; text by default."""
    mask = b"\x01\x02\x03\x04"
    n = len(payload)
    header = bytes([0x80 | opcode])
    if n < 126:
        header += bytes([0x80 | n])
    elif n < 65536:
        header += bytes([0x80 | 126]) + n.to_bytes(2, "big")
    else:
        header += bytes([0x80 | 127]) + n.to_bytes(8, "big")
    return header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def send_until_blocked(sock: socket.socket, data: bytes, block_s: float = 3.0) -> int:
    """Write `data` until done or until the peer stops reading for `block_s`; bytes written."""
    sock.settimeout(block_s)
    sent = 0
    try:
        while sent < len(data):
            sent += sock.send(data[sent:sent + 65536])
    except (TimeoutError, socket.timeout, OSError):
        pass
    return sent


def read_until_reset(sock: socket.socket, timeout: float = 20.0) -> bool:
    """Drain what the server sent; True once the connection is closed or reset (a hang is False)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except (TimeoutError, socket.timeout):
        return False
