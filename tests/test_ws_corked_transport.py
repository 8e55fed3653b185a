"""gateway.ws.socket.CorkedTransport over a real socket: the writes of one event-loop iteration
leave together, after it; a close sends what is held first; an abort drops it."""

from __future__ import annotations

import asyncio
import socket

from gateway.ws.socket import CorkedTransport


async def _pair() -> tuple[CorkedTransport, asyncio.Transport, socket.socket]:
    ours, peer = socket.socketpair()
    peer.setblocking(False)
    transport, _ = await asyncio.get_running_loop().create_connection(asyncio.Protocol, sock=ours)
    return CorkedTransport(transport), transport, peer


def _read(peer: socket.socket) -> bytes:
    try:
        return peer.recv(1 << 16)
    except BlockingIOError:
        return b""


async def test_one_iterations_writes_leave_together_after_it():
    corked, transport, peer = await _pair()
    try:
        for part in (b"frame-1;", b"frame-2;", b"frame-3;"):
            corked.write(part)
        assert _read(peer) == b""                          # held: nothing written yet
        assert corked.get_write_buffer_size() == 24        # held bytes count as buffered
        await asyncio.sleep(0)                             # the iteration ends: one write
        assert _read(peer) == b"frame-1;frame-2;frame-3;"
        assert corked.get_write_buffer_size() == 0
        corked.writelines([b"a", b"b"])
        await asyncio.sleep(0)
        assert _read(peer) == b"ab"
        assert corked.get_extra_info("socket") is transport.get_extra_info("socket")   # the rest: the transport's
    finally:
        transport.abort()
        peer.close()


async def test_close_sends_what_is_held_and_abort_drops_it():
    corked, transport, peer = await _pair()
    corked.write(b"last frame")
    corked.close()                                         # e.g. uvicorn: a close frame, then close()
    assert _read(peer) == b"last frame"
    assert corked.is_closing()
    peer.close()

    corked, transport, peer = await _pair()
    corked.write(b"never sent")
    corked.abort()
    await asyncio.sleep(0)                                 # (its scheduled flush runs: nothing held)
    assert _read(peer) == b""                              # EOF: the held write was dropped
    peer.close()
