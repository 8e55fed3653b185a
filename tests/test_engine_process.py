"""The engine in its own process: same outputs as in a thread, cancels, credit-bounded buffering,
load figures, and no engine that outlives its worker (or a worker that misses a dead engine).
A synthetic engine (no torch) keeps each launch to a fraction of a second plus interpreter start."""

from __future__ import annotations

import asyncio
import collections
import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shared.sampling import SamplingParams
from shared.streams import RequestEntry
from tests.gateway_client import eventually
from tests.stack_fixtures import pid_alive
from worker.engine import build_prompt_ids
from worker.engine_process import EngineProcess, EngineStartFailed
from worker.engine_client import Add, Cancel
from worker.engine_thread import EngineThread
from worker.synthetic import SyntheticEngine

ROOT = Path(__file__).resolve().parent.parent


def synthetic(step_ms: float = 1.0, max_batch: int = 8):
    return functools.partial(SyntheticEngine, max_batch=max_batch, step_ms=step_ms)


def add(rid: str, max_tokens: int, prompt: str = "a few words") -> Add:
    return Add(RequestEntry(rid=rid, params=SamplingParams(max_tokens=max_tokens), prompt=prompt, gw="g"))


async def collect(engine, rids: set[str], timeout: float = 20.0) -> dict[str, list]:
    """Outputs per rid until each has its final, taken the way the worker's writer takes them
    (through the EngineClient interface: the same calls for the thread and the process)."""
    woke = asyncio.Event()
    engine.start(woke.set)
    got: dict[str, list] = collections.defaultdict(list)
    open_rids = set(rids)
    deadline = time.monotonic() + timeout
    while open_rids and time.monotonic() < deadline:
        try:
            await asyncio.wait_for(woke.wait(), 0.1)
        except TimeoutError:
            pass
        woke.clear()
        for out in engine.take_outputs():
            got[out.rid].append(out)
            if out.finished:
                open_rids.discard(out.rid)
    assert not open_rids, f"no final for {open_rids}"
    return got


@pytest.fixture
def engine_process():
    procs = []

    def launch(build=None, buffer_max: int = 4096) -> EngineProcess:
        proc = EngineProcess(build or synthetic(), max_prompt_tokens=100, buffer_max=buffer_max)
        proc.launch(timeout=60)
        procs.append(proc)
        return proc
    yield launch
    for proc in procs:
        proc.stop()


async def test_outputs_equal_the_thread_engines_and_cancels_end_requests(engine_process):
    proc = engine_process()
    assert proc.kv_total == 8 * 4096
    for rid, n in (("a", 5), ("b", 12), ("long", 100_000), ("quiet", 100_000)):
        proc.submit(add(rid, n))
    proc.submit(Cancel("quiet", silent=True))
    proc.submit(Cancel("long"))
    got = await collect(proc, {"a", "b", "long"})

    thread = EngineThread(synthetic()(), max_prompt_tokens=100, buffer_max=4096)
    for rid, n in (("a", 5), ("b", 12)):
        thread.submit(add(rid, n))
    want = await collect(thread, {"a", "b"})
    thread.stop()
    for rid in ("a", "b"):
        fields = [(o.text, o.token_ids, o.finished, o.finish_reason, o.prompt_tokens, o.completion_tokens)
                  for o in got[rid]]
        assert fields == [(o.text, o.token_ids, o.finished, o.finish_reason, o.prompt_tokens, o.completion_tokens)
                          for o in want[rid]]
        assert all(o.emitted_ms > 0 for o in got[rid])
    assert got["long"][-1].finish_reason == "cancelled" and got["long"][-1].completion_tokens < 100_000
    # load figures arrive with outputs and every 0.5 s: the engine reports nothing running ...
    assert await eventually(lambda: not proc.running and proc.steps > 0, timeout=5, interval=0.05)
    assert proc.running == 0 and proc.waiting == 0 and proc.steps > 0 and proc.unhealthy_reason == ""
    # ... so every output of "quiet" has crossed the pipe (they come before the figures of the step
    # that applied its cancel): a silent cancel ends it without a final (tokens of steps before
    # the cancel may come first)
    quiet = got["quiet"] + [o for o in proc.take_outputs() if o.rid == "quiet"]
    assert not any(o.finished for o in quiet)


async def test_a_prompt_over_the_limit_gets_its_typed_error_from_the_child(engine_process):
    proc = engine_process()
    proc.submit(add("big", 5, prompt="word " * 150))
    out = (await collect(proc, {"big"}))["big"]
    assert len(out) == 1 and out[0].finish_reason == "error" and out[0].error_code == "context_too_long"


async def test_untaken_outputs_pause_the_engine_until_the_parent_takes_them(engine_process):
    """With nobody taking outputs the engine stops stepping once the parent holds `buffer_max`
    (plus the step that found no credit): bounded memory while Redis is down."""
    proc = engine_process(synthetic(step_ms=1.0, max_batch=4), buffer_max=16)
    proc.start(lambda: None)
    for i in range(4):
        proc.submit(add(f"r{i}", 100_000))
    # the parent holds a buffer's worth: from here the child has no credit and sends no outputs
    assert await eventually(lambda: len(proc._outputs) >= 16, timeout=30, interval=0.05)
    held = len(proc._outputs)
    assert 16 <= held < 16 + 4, held                    # it sent only while the parent held < 16
    # the synthetic engine gives the request admitted first its n-th token at step n: the steps
    # whose outputs came over
    sent = max(o.completion_tokens for o in proc._outputs)
    # the one step that found no credit shows in the next load figures (sent when no output
    # carried them for 0.5 s); an engine that went on stepping would have sent its outputs
    assert await eventually(lambda: proc.steps == sent + 1, timeout=10, interval=0.05), (sent, proc.steps)
    steps = proc.steps
    assert len(proc._outputs) == held and steps <= 16 + 1   # at most a step a held output, + the waiting one
    taken = len(proc.take_outputs())
    await eventually(lambda: proc.steps > steps, timeout=5, interval=0.05)
    assert taken == held and proc.steps > steps         # credit returned: it steps again


async def test_a_dead_engine_process_is_seen(engine_process):
    proc = engine_process()
    woke = asyncio.Event()
    proc.start(woke.set)
    assert proc.is_alive()
    os.kill(proc.pid, signal.SIGKILL)
    await asyncio.wait_for(woke.wait(), 5)
    assert not proc.is_alive()


def synthetic_with_tokenizer(model_dir: str) -> SyntheticEngine:
    """A synthetic engine holding a real tokenizer (the tiny model's: SmolLM2's)."""
    from transformers import AutoTokenizer
    engine = SyntheticEngine(max_batch=2, step_ms=1.0)
    engine.tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return engine


async def test_tokenize_requests_get_the_same_answers_from_the_process_and_the_thread(engine_process, tiny_model_dir,
                                                                                       tokenizer):
    """EngineClient.tokenize (worker.tokenization.answer on a thread beside the engine's) while
    the engine runs a request, in the child and in a thread; a dead child answers with an error."""
    import msgpack
    build = functools.partial(synthetic_with_tokenizer, str(tiny_model_dir))
    proc = engine_process(build)
    proc.start(lambda: None)
    thread = EngineThread(build(), max_prompt_tokens=100, buffer_max=4096)
    thread.start(lambda: None)
    ids = tokenizer("Hello there", add_special_tokens=True)["input_ids"]
    requests = [{"k": "tokenize", "prompt": "Hello there", "return_token_strs": True},
                {"k": "tokenize", "messages": [{"role": "user", "content": "Hi"}]},
                {"k": "detokenize", "tokens": ids},
                {"k": "detokenize", "tokens": [len(tokenizer)]}]
    try:
        for engine in (proc, thread):
            engine.submit(add("busy", 100_000))
        answers = [msgpack.unpackb(msgpack.packb(await proc.tokenize(r))) for r in requests]   # tuples -> lists
        assert answers == [await thread.tokenize(r) for r in requests]
    finally:
        thread.stop()
    assert answers[0] == {"tokens": ids, "token_strs": tokenizer.convert_ids_to_tokens(ids), "max_model_len": 0}
    assert answers[1]["tokens"] == build_prompt_ids(tokenizer, None, [{"role": "user", "content": "Hi"}])
    assert answers[2] == {"prompt": "Hello there"}
    assert answers[3]["error"]["param"] == "tokens"
    os.kill(proc.pid, signal.SIGKILL)
    await eventually(lambda: not proc.is_alive(), timeout=5)
    assert (await proc.tokenize(requests[0]))["error"]["code"] == "internal"


def test_a_failing_build_is_reported_at_launch():
    proc = EngineProcess(functools.partial(SyntheticEngine, max_batch=-1, step_ms=1.0, no_such_arg=1),
                         max_prompt_tokens=10, buffer_max=10)
    with pytest.raises(EngineStartFailed, match="no_such_arg"):
        proc.launch(timeout=60)


def test_the_engine_process_dies_with_its_worker(tmp_path):
    """SIGKILL of the worker (no chance to stop anything) still ends its engine process."""
    script = textwrap.dedent("""
        import functools, sys, time
        from worker.engine_process import EngineProcess
        from worker.synthetic import SyntheticEngine
        if __name__ == "__main__":
            proc = EngineProcess(functools.partial(SyntheticEngine, max_batch=2, step_ms=1.0),
                                 max_prompt_tokens=10, buffer_max=10)
            proc.launch(timeout=60)
            print(proc.pid, flush=True)
            time.sleep(600)
    """)
    path = tmp_path / "owner.py"
    path.write_text(script)
    owner = subprocess.Popen([sys.executable, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        child = int(owner.stdout.readline())
        os.kill(child, 0)                                   # it runs
        owner.kill()
        owner.wait(10)
        deadline = time.monotonic() + 10
        while pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(child), "the engine process outlived its worker"
    finally:
        owner.kill()



def test_finals_and_load_figures_carry_the_prefix_cache_figures_across_the_pipe():
    """A final's cached prompt tokens and the engine's hit-rate totals reach the parent."""
    import msgpack

    from shared.errors import ErrorCode
    from worker.engine import StepOutput
    from worker.engine_process import _status
    from worker.engine_wire import pack_outputs, unpack_outputs
    final = StepOutput("r", "x", [5], True, "length", 40, 3, None, None, 123, cached_tokens=32)
    error = StepOutput("e", "", [], True, "error", 9, 0, ErrorCode.INTERNAL, "boom", 124)
    token = StepOutput("t", "y", [6], False, None, 40, 1, None, None, 125)
    for out in (final, error, token):
        assert unpack_outputs(msgpack.unpackb(msgpack.packb(pack_outputs([out])))) == [out]
    both = unpack_outputs(msgpack.unpackb(msgpack.packb(pack_outputs([token, final, error, token]))))
    assert both == [token, final, error, token] and type(both[2].error_code) is ErrorCode
    thread = EngineThread(synthetic()(), max_prompt_tokens=100, buffer_max=16)
    thread.prefix_cache_queries, thread.prefix_cache_hits = 1000, 640
    proc = EngineProcess(synthetic(), max_prompt_tokens=100, buffer_max=16)
    proc._apply_status(msgpack.unpackb(msgpack.packb(_status(thread))))
    assert (proc.prefix_cache_queries, proc.prefix_cache_hits) == (1000, 640)


async def test_a_paced_engine_thread_delivers_first_tokens_and_finals_at_once_and_the_rest_per_tick():
    """EngineThread.pace_s: outputs of several steps go out together, at most once per pace,
    except a request's first token and its final, which go at once; nothing is lost or reordered."""
    pace = 0.2
    deliveries: list[tuple[float, list]] = []
    done = asyncio.Event()
    loop = asyncio.get_running_loop()

    def delivered() -> None:           # in the engine thread, as the engine process's pipe link
        outs = thread.take_outputs()
        deliveries.append((time.monotonic(), outs))
        if any(o.finished for o in outs):
            loop.call_soon_threadsafe(done.set)

    thread = EngineThread(synthetic(step_ms=2.0)(), max_prompt_tokens=100, buffer_max=4096, on_output=delivered)
    thread.start(pace_s=pace)
    thread.submit(add("a", 60))
    await asyncio.wait_for(done.wait(), 60)
    thread.stop()
    outs = [o for _, batch in deliveries for o in batch]
    assert [o.completion_tokens for o in outs if o.token_ids] == list(range(1, 61))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    # the first token was delivered on its own step, not held for a tick
    assert deliveries[0][1][0].completion_tokens == 1 and len(deliveries[0][1]) == 1
    # every other delivery that carries no first token and no final came a full pace after the
    # one before (a step longer than the pace makes that gap longer still)
    for (before, _), (at, batch) in zip(deliveries, deliveries[1:]):
        if not any(o.finished for o in batch):
            assert at - before >= pace, (at - before, [o.completion_tokens for o in batch])
