"""The CPU engine's thread policy (worker/engine/threads.py): how many cores it may use, how
many threads a step takes by its size, and the OpenMP spin default the worker sets for its
engine process. Speed is in bench/serving.py; here: the decisions, and that a step really runs
with the count its size asks for, with the same tokens either way."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from shared.config import Settings
from shared.sampling import SamplingParams
from worker.engine import Engine, EngineConfig, EngineRequest
from worker.engine import row_kernels as row_kernels_module
from worker.engine.threads import SPIN_ENV, StepThreads, default_torch_threads, usable_cores, wide_torch_threads


def test_usable_cores_are_the_affinity_capped_by_the_cgroup_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert usable_cores(str(tmp_path)) == affinity                 # no cpu.max: the affinity
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(str(tmp_path)) == affinity
    (tmp_path / "cpu.max").write_text("150000 100000\n")          # --cpus 1.5: 2 cores at most
    assert usable_cores(str(tmp_path)) == min(affinity, 2)
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert usable_cores(str(tmp_path)) == 1


def test_few_token_steps_leave_a_core_and_many_token_steps_take_them_all():
    assert [default_torch_threads(c) for c in (1, 2, 8)] == [1, 1, 7]
    calls: list[int] = []
    threads = StepThreads(narrow=1, wide=2, from_tokens=8, set_threads=calls.append)
    assert threads.active
    assert [threads.fit(n) for n in (1, 1, 16, 300, 7, 8, 2)] == [1, 1, 2, 2, 1, 2, 1]
    assert calls == [2, 1, 2, 1]                                    # only when the size crosses the line
    assert not StepThreads(3, 0, 8, set_threads=calls.append).active      # fixed count
    assert not StepThreads(1, 2, 0, set_threads=calls.append).active      # TORCH_WIDE_FROM_TOKENS=0


def test_wide_threads_only_under_the_default_policy_on_cpu(monkeypatch):
    monkeypatch.setattr("worker.engine.threads.usable_cores", lambda: 4)
    assert wide_torch_threads(Settings(torch_threads=0)) == 4
    assert wide_torch_threads(Settings(torch_threads=0), "cuda") == 0
    assert wide_torch_threads(Settings(torch_threads=2)) == 0          # a fixed count stays fixed
    assert wide_torch_threads(Settings(torch_threads=0, torch_wide_from_tokens=0)) == 0
    monkeypatch.setattr("worker.engine.threads.usable_cores", lambda: 1)
    assert wide_torch_threads(Settings(torch_threads=0)) == 0          # one core: nothing to widen to


@pytest.mark.parametrize("row_kernels", [False, True])
def test_a_step_runs_with_the_threads_its_size_asks_for_and_the_same_tokens(model, tokenizer, row_kernels):
    """A prefill chunk takes every core; a decode row takes all but one in the layer loop, and
    every core where the step runs every layer in one call (decode_layers.cpp); the tokens are
    the same as with one thread throughout."""
    before = torch.get_num_threads()
    seen: list[tuple[int, bool, int]] = []

    class Recording(StepThreads):
        def fit(self, tokens: int, one_call: bool = False) -> int:
            seen.append((tokens, one_call, super().fit(tokens, one_call)))
            return seen[-1][2]
    try:
        torch.set_num_threads(1)

        def run(wide: int):
            engine = Engine(model, tokenizer, EngineConfig(max_batch=4, max_seq_len=256, prefill_chunk=32,
                                                           wide_threads=wide, wide_from_tokens=4,
                                                           row_kernels=row_kernels))
            if wide:
                assert isinstance(engine.runner.threads, StepThreads)
                engine.runner.threads = Recording(1, wide, 4)
            prompt = tokenizer("The sea and the sky, a story", add_special_tokens=False)["input_ids"]
            engine.add(EngineRequest("a", prompt, SamplingParams(max_tokens=12, temperature=0.0)))
            tokens: dict[str, list[int]] = {}
            while engine.has_work:
                for out in engine.step():
                    tokens.setdefault(out.rid, []).extend(out.token_ids)
                    if wide:
                        assert torch.get_num_threads() == seen[-1][2]
            return tokens, engine

        narrow_only, _ = run(0)
        adaptive, engine = run(2)
    finally:
        torch.set_num_threads(before)
    assert adaptive == narrow_only and len(adaptive["a"]) == 12
    one_call = engine.runner.one_call_decode
    if row_kernels and row_kernels_module.load() is not None:
        assert one_call
    assert seen[0][0] >= 4 and not seen[0][1] and seen[0][2] == 2     # the prompt's prefill: every core
    assert len(seen) > 5 and all(call == one_call and k == (2 if one_call else 1) for n, call, k in seen[1:])


def test_the_worker_bounds_openmp_spinning_for_its_engine_process_unless_told():
    probe = ("import os, worker.__main__ as m; m.openmp_spin_defaults(); "
             "print(os.environ['GOMP_SPINCOUNT'])")
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == SPIN_ENV["GOMP_SPINCOUNT"]
    out = subprocess.run([sys.executable, "-c", probe], env={**env, "GOMP_SPINCOUNT": "123"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "123"
