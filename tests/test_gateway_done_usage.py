"""`done.usage` of a resumed request (docs/protocol.md): a client that resumes a finished request
still gets the request's time to first token (the worker's figure), like a live one does."""

from __future__ import annotations

from tests.gateway_client import GatewayClient
from tests.stack_fixtures import StackSpec, gateway_in_process

STACK = StackSpec("w-usage", synthetic=True)


async def test_a_resumed_finished_request_reports_its_ttft(make_settings):
    async with gateway_in_process(make_settings()) as gw:
        live = await GatewayClient.connect(gw.ws_url)
        request_id = await live.generate("a", prompt="x", max_tokens=6)
        _, done = await live.until_done("a")
        assert done["usage"]["ttft_ms"] > 0 and done["usage"]["completion_tokens"] == 6
        await live.close()
        for last_seq in (0, 6):           # from the start, and with nothing left but the end
            later = await GatewayClient.connect(gw.ws_url)
            await later.send(type="resume", id="b", last_seq=last_seq, request_id=request_id)
            chunks, again = await later.until_done("b")
            assert sum(c["tokens"] for c in chunks) == 6 - last_seq
            assert again["finish_reason"] == "length" and again["seq"] == 6
            assert isinstance(again["usage"]["ttft_ms"], (int, float)) and again["usage"]["ttft_ms"] >= 0
            assert again["usage"]["completion_tokens"] == 6
            await later.close()
