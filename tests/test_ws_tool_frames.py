"""The WebSocket's typed tool-call frames (gateway.ws.tool_frames), in-process: the frames are a
function of the text, whatever its chunking, and a resume after any chunk the client had gives
exactly the frames it lacked — every call started once, its deltas adding up to its arguments,
done once with the whole arguments (an end-of-request frame that the client may already hold
only as a repeat of what it has, told by its `index`). The end-to-end run over a real socket
is in tests/test_openai_structured.py.
"""

from __future__ import annotations

import json
import random

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.ws.tool_frames import ToolFrames
from shared.protocol import Chunk, Done, ToolCallDelta, ToolCallDone, ToolCallStart, Usage

RID = "ab" * 16
CALL = '{"name": "get_weather", "arguments": {"city": {"name": "Oslo "}, "days": [1, 2]}}'
AUTO = (f'Let me check. <tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call> Done <tool')
TEXTS = {"forced": CALL, "auto": AUTO}


def tokens(text: str) -> list[str]:
    """The text as tokens of 1 to 3 characters (a fixed cut)."""
    rng, out, i = random.Random(7), [], 0
    while i < len(text):
        n = rng.randint(1, 3)
        out.append(text[i:i + n])
        i += n
    return out


async def run(frames: ToolFrames, toks: list[str], cuts: list[int], start: int, reason: str = "stop") -> list:
    """Send chunks ending at token `cuts` (after token `start`), then `done`: every frame sent."""
    out, seq = [], start
    for cut in cuts + [len(toks)]:
        if cut <= seq:
            continue
        chunk = Chunk(id="r1", seq=cut, text="".join(toks[seq:cut]), tokens=cut - seq)
        out += await frames.frames(chunk) + [chunk]
        seq = cut
    done = Done(id="r1", seq=seq, finish_reason=reason, usage=Usage())
    return out + await frames.frames(done) + [done]


def calls_of(frames: list, *, repeats_ok: bool = False) -> dict[int, dict]:
    """What a client keeps: per call index, its id, name, the deltas joined and the done's
    arguments; a second start or done of one index fails, unless `repeats_ok` (then it must
    repeat exactly what the client has)."""
    calls: dict[int, dict] = {}
    for f in frames:
        if isinstance(f, ToolCallStart):
            if f.index in calls:
                assert repeats_ok and calls[f.index]["start"] == f.model_dump(exclude={"seq"}), f
            calls.setdefault(f.index, {"start": f.model_dump(exclude={"seq"}), "deltas": "", "done": None})
        elif isinstance(f, ToolCallDelta):
            assert calls[f.index]["done"] is None, "a delta after the call's done"
            calls[f.index]["deltas"] += f.arguments
        elif isinstance(f, ToolCallDone):
            if calls[f.index]["done"] is not None:
                assert repeats_ok and calls[f.index]["done"] == f.model_dump(exclude={"seq"}), f
            calls[f.index]["done"] = f.model_dump(exclude={"seq"})
    return calls


def check_order(frames: list) -> None:
    """Each tool frame goes out just before the chunk (or done) whose seq it carries."""
    for i, f in enumerate(frames):
        if isinstance(f, (ToolCallStart, ToolCallDelta, ToolCallDone)):
            nxt = next(g for g in frames[i + 1:] if isinstance(g, (Chunk, Done)))
            assert f.seq == nxt.seq, (f, nxt)


async def no_history(rid: str, seq: int):
    raise AssertionError("a request tracked from its first token reads no history")


@pytest.mark.parametrize("mode", ["forced", "auto"])
async def test_frames_are_a_function_of_the_text(mode):
    toks = tokens(TEXTS[mode])
    results = []
    for cuts in ([], list(range(1, len(toks))), list(range(2, len(toks), 5)), [len(toks) // 2]):
        frames = ToolFrames(no_history)
        frames.track("r1", RID, mode)
        sent = await run(frames, toks, cuts, 0)
        check_order(sent)
        results.append(calls_of(sent))
    assert all(r == results[0] for r in results)
    calls = results[0]
    names = ["get_weather"] if mode == "forced" else ["get_weather", "get_time"]
    assert [c["start"]["name"] for c in calls.values()] == names
    ids = [c["start"]["call_id"] for c in calls.values()]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") and RID not in i for i in ids)   # (rid: a secret)
    for c in calls.values():
        whole = c["done"]["arguments"]
        json.loads(whole)
        assert whole.startswith(c["deltas"])        # what the end alone could tell is in the done only
    assert calls[0]["done"]["arguments"] == '{"city": {"name": "Oslo "}, "days": [1, 2]}'


@pytest.mark.parametrize("mode", ["forced", "auto"])
async def test_a_resume_after_any_chunk_gives_exactly_the_rest(mode):
    toks = tokens(TEXTS[mode])

    async def text_through(rid: str, seq: int) -> str:       # (RequestCore.text_through: from the history)
        assert rid == RID
        return "".join(toks[:seq])

    first_cuts = list(range(3, len(toks), 4))
    whole = ToolFrames(no_history)
    whole.track("r1", RID, mode)
    original = await run(whole, toks, first_cuts, 0)
    want = calls_of(original)
    for last in first_cuts + [len(toks)]:
        had = original[:original.index(next(f for f in original if isinstance(f, Chunk) and f.seq == last)) + 1]
        again = ToolFrames(text_through)
        again.track("r1", RID, mode, after_seq=last)
        rest = await run(again, toks, list(range(last + 1, len(toks))), last)    # cut otherwise than before
        check_order(rest)
        assert calls_of(had + rest, repeats_ok=last == len(toks)) == want, last
        if last < len(toks):                                                    # nothing seen twice
            assert calls_of(had + rest) == want
        else:          # a client that had all but `done`: the end's frames again, as repeats only
            assert calls_of(original[:-1] + rest, repeats_ok=True) == want


async def test_an_error_ends_no_call():
    toks = tokens(CALL)
    frames = ToolFrames(no_history)
    frames.track("r1", RID, "forced")
    sent = await run(frames, toks, [len(toks) // 2], 0, reason="error")
    kinds = {type(f) for f in sent}
    assert ToolCallStart in kinds and ToolCallDelta in kinds and ToolCallDone not in kinds


async def test_a_request_without_tools_or_an_unreadable_history_gets_no_frames():
    frames = ToolFrames(no_history)
    frames.track("r1", RID, None)
    assert await frames.frames(Chunk(id="r1", seq=1, text="<tool_call>", tokens=1)) == []

    async def gone(rid: str, seq: int) -> str:
        raise RedisConnectionError("Redis is away")
    resumed = ToolFrames(gone)
    resumed.track("r1", RID, "forced", after_seq=5)
    assert await resumed.frames(Chunk(id="r1", seq=9, text=CALL[20:40], tokens=4)) == []
    assert await resumed.frames(Done(id="r1", seq=9, finish_reason="stop", usage=Usage())) == []
    assert not resumed.calls
