"""Which models the engine runs exactly, checked once at load.

The engine replaces transformers' attention and cache with its own (`attention.py`), so a model
feature that lives in attention or in the rotary embedding must be re-implemented there or the
output is silently wrong. This module is the gate: a model family is accepted only when every
feature it uses is honoured, and each accepted family has a tiny random-model test against
`model.generate` (tests/test_engine_families.py). Anything else is refused with a message that
says what is missing, instead of producing plausible but wrong text.

Honoured: causal GQA/MHA attention, RoPE from position ids with a position-independent frequency
table (default, linear, llama3), sliding-window attention (a mask, per layer), q/k norms (Qwen3,
the model's own norm modules, called by `decoder.py`), q/k/v biases (Qwen2).
Refused: soft-capped attention or logits (Gemma 2), RoPE scaling whose frequencies depend on the
sequence length (dynamic NTK, longrope, yarn untested), any other family.
"""

from __future__ import annotations

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# rope types whose cos/sin depend only on the position (not on the batch's longest sequence)
STATIC_ROPE_TYPES = (None, "default", "linear", "llama3")


class UnsupportedModel(ValueError):
    """The engine cannot run this model exactly; the message says why."""


def _rope_type(cfg) -> str | None:
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(cfg, attr, None)
        if isinstance(params, dict) and params:
            # per-layer-type dicts (e.g. {"full_attention": {...}}) hold nested params
            if all(isinstance(v, dict) for v in params.values()):
                types = {v.get("rope_type", v.get("type")) for v in params.values()}
                return types.pop() if len(types) == 1 else f"mixed {sorted(map(str, types))}"
            return params.get("rope_type", params.get("type"))
    return None


def check_supported(model_config) -> None:
    """Raise UnsupportedModel unless the engine reproduces this model's forward pass exactly."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    family = getattr(cfg, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise UnsupportedModel(f"model family {family!r} is not supported by the engine "
                               f"(supported: {', '.join(SUPPORTED_FAMILIES)})")
    for attr in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, attr, None):
            raise UnsupportedModel(f"{attr}={getattr(cfg, attr)} (soft-capped attention/logits) is not "
                                   "implemented by the engine's attention")
    rope = _rope_type(cfg)
    if rope not in STATIC_ROPE_TYPES:
        raise UnsupportedModel(f"RoPE scaling {rope!r} is not supported: its frequencies depend on the "
                               "sequence length, which differs per request in a packed batch "
                               f"(supported: {', '.join(str(t) for t in STATIC_ROPE_TYPES[1:])})")
    window = getattr(cfg, "sliding_window", None)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise UnsupportedModel(f"sliding_window={window!r} is not a positive integer")
