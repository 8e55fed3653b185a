"""Resume at ANY token (issue 34 item 1): a worker flushing rarely writes events of many tokens,
and a client may resume after a token inside one of them. Every resume point 0..N of one seeded
run, over the WebSocket (`resume`) and over SSE (`Last-Event-ID`), gives exactly the rest of
the uninterrupted answer: its tokens, its logprobs, and the text the worker's streaming
detokenizer released after that token (checked against the tokenizer, independently of the
events' own per-token lengths). `output_lost` comes only when the tokens are really gone.
"""

from __future__ import annotations

import json

import httpx

from shared.events import TokEvent
from shared.streams import Keys
from tests.gateway_client import GatewayClient
from tests.stack_fixtures import StackSpec, gateway_in_process
from tests.worker_redis import read_events

# events of many tokens: the worker writes a request's new tokens at most every 400 ms
STACK = StackSpec("w-anywhere", env={"WORKER_FLUSH_MS": "400"})
MAX_TOKENS = 40
PARAMS = dict(max_tokens=MAX_TOKENS, temperature=1.0, seed=34, logprobs=True, top_logprobs=2)


def released_through(tokenizer, ids: list[int], k: int) -> str:
    """The text a streaming detokenizer has released after tokens 1..k: the decode of the
    longest prefix of them that does not end inside a character (held back until completed)."""
    j = k
    while j > 0 and tokenizer.decode(ids[:j], skip_special_tokens=True).endswith("\ufffd"):
        j -= 1
    return tokenizer.decode(ids[:j], skip_special_tokens=True)


async def history_tokens(redis_client, keys: Keys, rid: str) -> tuple[list[int], list[dict]]:
    events = await read_events(redis_client, keys, rid)
    return [i for e in events if e["k"] == "tok" for i in e["ids"]], events


def sse_events(text: str) -> list[tuple[int | None, dict | str]]:
    out = []
    for block in text.split("\n\n"):
        eid, data = None, None
        for line in block.split("\n"):
            if line.startswith("id: "):
                eid = int(line[4:])
            elif line.startswith("data: "):
                data = line[6:]
        if data is not None:
            out.append((eid, data if data == "[DONE]" else json.loads(data)))
    return out


def sse_parts(events) -> tuple[str, list[dict], list[str]]:
    """Content, per-token logprobs, and error codes of an SSE stream's events."""
    text, lps, errors = [], [], []
    for _, data in events:
        if isinstance(data, str):
            continue
        if "error" in data:
            errors.append(data["error"].get("code"))
        for choice in data.get("choices", []):
            text.append(choice.get("delta", {}).get("content") or "")
            lps.extend(((choice.get("logprobs") or {}).get("content")) or [])
    return "".join(text), lps, errors


async def test_every_resume_point_over_the_websocket_is_exact(redis_client, stack, tokenizer):
    keys = Keys(stack.prefix)
    settings = stack.settings(resume_rate_per_min=0, resume_grace_s=30)
    async with gateway_in_process(settings) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        rid = await c.generate("ref", prompt="Tell me a story about Zürich, 東京 and café:", **PARAMS)
        chunks, done = await c.until_done("ref")
        await c.close()
        assert done["type"] == "done", done
        ids, events = await history_tokens(redis_client, keys, rid)
        n = len(ids)
        assert n == done["usage"]["completion_tokens"] == sum(ch["tokens"] for ch in chunks) > 0
        assert max(e["n"] for e in events if e["k"] == "tok") > 3, "the events should hold many tokens"
        full = "".join(ch["text"] for ch in chunks)
        ref_lp = [lp for ch in chunks for lp in ch["logprobs"]]
        assert len(ref_lp) == n
        previous = None
        for k in range(n + 1):
            r = await GatewayClient.connect(gw.ws_url)
            await r.send(type="resume", id="again", last_seq=k, request_id=rid)
            assert (await r.recv("again", timeout=30))["type"] == "accepted"
            rest, fin = await r.until_done("again", timeout=60)
            await r.close()
            assert fin["type"] == "done" and fin["seq"] == n, (k, fin)
            text = "".join(ch["text"] for ch in rest)
            assert sum(ch["tokens"] for ch in rest) == n - k and (not rest or rest[0]["seq"] - rest[0]["tokens"] == k)
            assert [lp for ch in rest for lp in ch["logprobs"]] == ref_lp[k:], k
            assert full.endswith(text) and full[:len(full) - len(text)] == released_through(tokenizer, ids, k) \
                if k < n else text == "", (k, text)
            assert previous is None or previous.endswith(text)
            previous = text


async def test_every_resume_point_over_sse_is_exact_and_lost_tokens_are_output_lost(redis_client, stack, tokenizer):
    keys = Keys(stack.prefix)
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Schreib über Köln, 北京 und Crème brûlée"}],
            "stream": True, "resumable": True, **PARAMS}
    async with gateway_in_process(stack.settings(resume_grace_s=30)) as gw:
        async with httpx.AsyncClient(timeout=60) as http:
            resp = await http.post(gw.base + "/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            ref = sse_events(resp.text)
            oai_id = ref[0][1]["id"]
            rid = oai_id.split("-", 1)[1]
            full, ref_lp, errors = sse_parts(ref)
            assert not errors
            ids, events = await history_tokens(redis_client, keys, rid)
            n = len(ids)
            assert len(ref_lp) == n > 0 and max(e["n"] for e in events if e["k"] == "tok") > 3
            for k in range(n + 1):
                resp = await http.get(gw.base + f"/v1/streams/{oai_id}", headers={"Last-Event-ID": str(k)})
                assert resp.status_code == 200, (k, resp.text)
                rest = sse_events(resp.text)
                text, lps, errors = sse_parts(rest)
                assert not errors and rest[-1][1] == "[DONE]", (k, rest[-2:])
                assert lps == ref_lp[k:], k
                assert full.endswith(text), (k, text)
                if k < n:
                    assert full[:len(full) - len(text)] == released_through(tokenizer, ids, k), (k, text)
                assert all(eid >= k for eid, _ in rest if eid is not None), (k, [e for e, _ in rest])
            # the tokens really gone (the history's event holding token `k + 1` trimmed): output_lost
            inside = next(e for e in events if e["k"] == "tok" and e["n"] > 2)
            k = inside["seq"] - inside["n"] + 1
            await redis_client.xdel(keys.out(rid), inside["_id"])
            resp = await http.get(gw.base + f"/v1/streams/{oai_id}", headers={"Last-Event-ID": str(k)})
            if resp.status_code == 200:
                assert "output_lost" in sse_parts(sse_events(resp.text))[2], resp.text
            else:
                assert resp.status_code == 503 and resp.json()["error"]["code"] == "output_lost", resp.text
