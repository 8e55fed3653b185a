"""The WebSocket transport (`/v1/stream`, docs/protocol.md): a thin adapter over the request core.

* endpoint.py     the handshake (subprotocol, origin, socket caps, key) and the hand-over;
* connection.py   one socket as a session: its reader loop, request table and sender;
* dispatch.py     the reader loop: auth, generate, cancel, resume, ping;
* socket.py       `FrameSocket`: the socket's `Writer` (encode, send, time, close, abort);
* socket_caps.py  the per-key and per-address socket counts.
"""
