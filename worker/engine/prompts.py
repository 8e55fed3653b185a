"""A prompt or chat messages -> token ids, with any tokenizer (no torch needed)."""

from __future__ import annotations


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
