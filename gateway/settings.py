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
    slow_consumer_s: float = Field(10.0, description="a send blocked this long closes the socket (SLOW_CONSUMER)")
    auth_timeout_s: float = Field(10.0, description="how long a socket may stay unauthenticated waiting for {type: auth}")
    admission_cache_ms: int = Field(200, description="how long one read of the queue depth is reused")
    concurrency_lease_s: float = Field(30.0, description="lease of one per-key concurrency slot (refreshed while active)")
    cancel_fallback_s: float = Field(5.0, description="if the worker has not confirmed a cancel after this long, "
                                                      "the gateway finishes the request itself")
    sweep_interval_s: float = Field(0.5, description="how often orphaned requests past their grace are looked for")
    served_model_name: str = Field("SmolLM2-135M-Instruct",
                                   description="the model name of the OpenAI-compatible API (`model`, /v1/models)")
    ws_max_size: int = Field(0, description="WebSocket frames above this close the socket (1009); "
                                            "0 = 4 x max_frame_bytes so oversize frames up to that get a typed error")

    @property
    def ws_max_size_bytes(self) -> int:
        return self.ws_max_size or 4 * self.max_frame_bytes
