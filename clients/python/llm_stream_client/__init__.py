"""llm-stream client SDK: one WebSocket, many concurrent requests, automatic reconnect and resume.

    async with StreamClient("ws://127.0.0.1:8000/v1/stream") as client:
        async for chunk in client.generate("Once upon a time", max_tokens=50, temperature=0):
            print(chunk.text, end="", flush=True)

See docs/clients.md.
"""

from llm_stream_client.client import Chunk, Generation, Result, StreamClient
from llm_stream_client.errors import (ConnectionLost, GenerationFailed, LLMStreamError, RequestRefused,
                                      ResumeExpired, Unauthorized)

__all__ = ["StreamClient", "Generation", "Chunk", "Result", "LLMStreamError", "RequestRefused", "ResumeExpired",
           "GenerationFailed", "Unauthorized", "ConnectionLost"]
