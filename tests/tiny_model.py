"""A tiny random-weight Llama with SmolLM2's real tokenizer, for fast tests.

The tokenizer is read from the SmolLM2 GGUF once and saved next to a 2-layer random model, so
every test process loads the directory in well under a second. Output text is gibberish but
deterministic for greedy/seeded sampling, which is all the plumbing tests need.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from worker.engine.model_files import SMOLLM2_GGUF, smollm2_dir


def make_tiny_model_dir(path: str | os.PathLike, *, layers: int = 2, hidden: int = 64, seed: int = 0,
                        initializer_range: float = 0.02) -> Path:
    """A larger `initializer_range` gives a model whose greedy output varies (the default one
    repeats a single token), e.g. for a failover test that needs a survivor that differs."""
    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir()), gguf_file=SMOLLM2_GGUF)
    tok.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
        tie_word_embeddings=True, initializer_range=initializer_range,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def tiny_llama(tokenizer, *, seed: int = 0) -> LlamaForCausalLM:
    """An in-memory 2-layer random Llama over `tokenizer` (untied head, initializer_range 0.1 so
    greedy outputs vary), for engine tests that compare against transformers' own forward."""
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()
