"""Multi-turn conversations two ways (issue 35 item 4): each turn by `previous_response_id` on
`/v1/responses` (the server rebuilds the conversation from the stored chain) vs each turn resending
the whole history through `/v1/chat/completions`. Reported per turn: TTFT p50 over the
conversations, input tokens and cached tokens (`input_tokens_details.cached_tokens` /
`prompt_tokens_details.cached_tokens`), in one run on one stack.

The stack: a fresh Redis, one `python -m worker` (SmolLM2-135M-Instruct unless --model-dir) and one
`python -m gateway`. Conversations run one after another, the two methods interleaved turn by turn
(so both see the same machine load); greedy answers of at most --answer-tokens. TTFT = request
sent -> first text delta received (streamed); a Responses delta is a whole word (its events are
cut by the text alone, docs/clients.md), so its first delta waits for the first blank. Every conversation starts with a fresh tag, so no
run hits what another left in the cache.

    .venv/bin/python bench/responses_turns.py --conversations 4 --turns 8
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from openai import AsyncOpenAI  # noqa: E402

from bench.common import percentile, table, write_json  # noqa: E402
from shared.localredis import LocalRedis  # noqa: E402
from tests.stack_fixtures import start_gateway, start_workers  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = " ".join(f"Rule {i}: you are a helpful assistant for a lighthouse keeper; answer in plain words."
                  for i in range(40))


def system(tag: str) -> str:
    return f"[{tag}] {SYSTEM}"


def question(tag: str, turn: int) -> str:
    return f"[{tag}] Question {turn}: tell me one more thing about lighthouses, ships and the sea at night."


async def responses_turn(c: AsyncOpenAI, state: dict, tag: str, turn: int, answer: int) -> dict:
    t0 = time.perf_counter()
    ttft = None
    final = None
    # instructions on every turn, as the Agents SDK sends them (a chain does not carry them over)
    kwargs = {"previous_response_id": state["prev"]} if state.get("prev") else {}
    async for e in await c.responses.create(model=MODEL, input=question(tag, turn), max_output_tokens=answer,
                                            instructions=system(tag), temperature=0, stream=True, **kwargs):
        if ttft is None and e.type == "response.output_text.delta":
            ttft = time.perf_counter() - t0
        if e.type in ("response.completed", "response.incomplete"):
            final = e.response
    state["prev"] = final.id
    return {"ttft_ms": (ttft or time.perf_counter() - t0) * 1000, "input": final.usage.input_tokens,
            "cached": final.usage.input_tokens_details.cached_tokens}


async def chat_turn(c: AsyncOpenAI, state: dict, tag: str, turn: int, answer: int) -> dict:
    messages = state.setdefault("messages", [{"role": "system", "content": system(tag)}])
    messages.append({"role": "user", "content": question(tag, turn)})
    t0 = time.perf_counter()
    ttft, text, usage = None, "", None
    async for ch in await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=answer, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}):
        if ch.choices and ch.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - t0
            text += ch.choices[0].delta.content
        if ch.usage:
            usage = ch.usage
    messages.append({"role": "assistant", "content": text})
    return {"ttft_ms": (ttft or time.perf_counter() - t0) * 1000, "input": usage.prompt_tokens,
            "cached": usage.prompt_tokens_details.cached_tokens}


async def run(args, base: str) -> dict:
    c = AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    per = {"responses": [[] for _ in range(args.turns)], "chat": [[] for _ in range(args.turns)]}
    await chat_turn(c, {}, "warm-up", 0, 4)      # the engine's first request pays its warm-up
    for _ in range(args.conversations):
        states = {"responses": {}, "chat": {}}
        tags = {m: uuid.uuid4().hex[:8] for m in states}
        for turn in range(args.turns):
            per["responses"][turn].append(await responses_turn(c, states["responses"], tags["responses"], turn,
                                                               args.answer_tokens))
            per["chat"][turn].append(await chat_turn(c, states["chat"], tags["chat"], turn, args.answer_tokens))
    rows = []
    for turn in range(args.turns):
        row = {"turn": turn + 1}
        for method, results in per.items():
            got = results[turn]
            row[f"{method} TTFT p50 ms"] = round(percentile([g["ttft_ms"] for g in got], 50), 1)
            row[f"{method} input"] = round(sum(g["input"] for g in got) / len(got))
            row[f"{method} cached"] = round(sum(g["cached"] for g in got) / len(got))
        rows.append(row)
    return {"rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--answer-tokens", type=int, default=48)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--threads", type=int, default=1, help="the worker's torch threads")
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="bench-responses-"))
    with LocalRedis() as redis:
        prefix = "bench" + uuid.uuid4().hex[:6]
        from worker.model_files import SMOLLM2_GGUF, smollm2_dir
        env = {"MAX_SEQ_LEN": 4096, "TORCH_THREADS": args.threads}
        if args.model_dir is None:
            env["MODEL_GGUF_FILE"] = SMOLLM2_GGUF
        workers = start_workers(redis.url, prefix, args.model_dir or smollm2_dir(), logs, ["w0"], env=env)
        gw, base = start_gateway(redis.url, prefix, logs, name="gw")
        try:
            result = asyncio.run(run(args, base))
        finally:
            for p in [gw, *workers]:
                p.stop()
    columns = list(result["rows"][0])
    print(table(result["rows"], columns))
    print("json:", write_json("responses_turns", {"args": vars(args), **result}))


if __name__ == "__main__":
    main()
