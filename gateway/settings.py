"""Gateway-only knobs on top of the shared `Settings` (same env-var mechanism).

Kept here rather than in shared/config.py because only the gateway reads them.
"""

from __future__ import annotations

from pydantic import Field

from shared.config import Settings


class GatewaySettings(Settings):
    resume_grace_s: float = Field(
        5.0, description="after a socket drops, its unfinished requests wait this long for a `resume` "
                         "(on any replica) before they are cancelled; 0 cancels at once")
    responses_ttl_s: int = Field(
        3600, description="how long a stored Responses API response (`store`: true) is kept: its request, input "
                          "and, once read finished, its output (the output history itself lasts OUTPUT_TTL_S)")
    max_n: int = Field(8, ge=1, description="most choices (`n`) one OpenAI request may ask for; each choice is a "
                                          "request of its own (per-key limits and admission count each)")
    slow_consumer_s: float = Field(10.0, description="a send blocked this long closes the socket (SLOW_CONSUMER)")
    auth_timeout_s: float = Field(10.0, description="how long a socket may stay unauthenticated waiting for {type: auth}")
    admission_cache_ms: int = Field(200, description="how long one read of the queue depth is reused")
    concurrency_lease_s: float = Field(30.0, description="lease of one per-key concurrency slot (refreshed while active)")
    cancel_fallback_s: float = Field(5.0, description="if the worker has not confirmed a cancel after this long, "
                                                      "the gateway finishes the request itself")
    sweep_interval_s: float = Field(0.5, description="how often orphaned requests past their grace are looked for")
    served_model_name: str = Field("SmolLM2-135M-Instruct",
                                   description="the model name of the OpenAI-compatible API (`model`, /v1/models)")
    send_queue_max_bytes: int = Field(64 * 1024, description="bytes of control frames (accepted, error, pong) "
                                                             "queued per socket before the client is too slow")
    max_sockets_per_key: int = Field(0, description="open sockets one API key may hold on this replica "
                                                    "(0 = no cap; anonymous sockets are capped per address)")
    max_sockets_per_address: int = Field(1000, description="open sockets one client address may hold on this "
                                                           "replica (0 = no cap); behind a proxy set "
                                                           "FORWARDED_ALLOW_IPS so the real address is seen")
    request_stall_s: float = Field(120.0, description="a request with no output event for this long (queued, "
                                                      "prefilling or decoding) ends with `stalled` (retryable); "
                                                      "0 = never")
    resume_rate_per_min: int = Field(30, description="resume attempts one socket may make per minute")
    cache_routing: bool = Field(True, description="send requests with the same route key (prompt_cache_key, or a "
                                                  "chat's messages up to its first user message) to the same worker "
                                                  "while it has room, where their shared prefix is cached "
                                                  "(docs/transport.md)")
    gateway_heartbeat_s: float = Field(1.0, description="how often a gateway refreshes its liveness entry")
    gateway_ttl_s: float = Field(5.0, description="a gateway silent this long is dead: a survivor parks its "
                                                  "requests for resume (cancelled after resume_grace_s)")
    inbox_block_ms: int = Field(2000, description="XREAD BLOCK time of the inbox reader (bounds nothing but "
                                                  "idle round trips)")
    socket_send_buffer: int = Field(0, description="SO_SNDBUF of each client socket in bytes (0 = the kernel's "
                                                   "auto-tuning, up to tcp_wmem max); bounds kernel memory per "
                                                   "non-reading client and how soon it is detected")
    ws_ping_s: float = Field(24.0, description="WebSocket protocol ping interval (end-to-end liveness through "
                                               "proxies; unanswered for PING_TIMEOUT_S closes the socket); "
                                               "0 = no pings")
    ws_per_message_deflate: bool = Field(False, description="offer WebSocket compression (permessage-deflate); "
                                                            "costs ~46 KB of zlib state per socket and CPU per frame "
                                                            "for little gain on short token chunks")
    ws_max_size: int = Field(0, description="WebSocket frames above this close the socket (1009); "
                                            "0 = 4 x max_frame_bytes so oversize frames up to that get a typed error")

    # the Batch API (gateway.batch; docs/clients.md "Batch API", docs/operations.md)
    batch_file_max_bytes: int = Field(20 * 1024 * 1024, description="largest file `POST /v1/files` accepts (413 "
                                                                    "above it); a file is one Redis value")
    batch_max_lines: int = Field(50_000, description="most requests one batch input file may hold")
    batch_file_ttl_s: int = Field(7 * 86400, description="how long uploaded files, batch output files and batch "
                                                         "objects stay in Redis")
    batch_concurrency: int = Field(8, description="requests of one batch in flight at once (its lines wait their "
                                                   "turn, so a batch cannot flood the request stream)")
    batch_runs_per_gateway: int = Field(4, description="batches one gateway replica runs at once")
    batch_lease_s: float = Field(10.0, description="a batch runner's lease; a replica that stops renewing it "
                                                   "(or that liveness declares dead) loses the batch to another")

    @property
    def ws_max_size_bytes(self) -> int:
        return self.ws_max_size or 4 * self.max_frame_bytes
