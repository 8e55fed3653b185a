"""The paged attention kernel (CUDA attention) and the engine paths that use it: on a GPU
directly, including CUDA graphs; on a CPU under Triton's interpreter, in a subprocess (the
interpreter is chosen when Triton is imported). `paged_attention_checks.py` holds the checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_paged_attention_on_cuda():
    from tests import paged_attention_checks as checks
    checks.check_kernel("cuda", torch.float32)
    checks.check_kernel("cuda", torch.bfloat16)
    checks.check_engine("cuda")
    checks.check_prefix_engine("cuda")
    checks.check_graphs_bf16()
    checks.check_kv_sizing()


@pytest.mark.timeout(900)     # Triton's interpreter is CPU-bound: minutes when it shares a busy box
def test_paged_attention_in_triton_interpreter():
    """Kernel against a float64 reference; engine on the kernel path equals generate for every
    family with its own attention quirks (GQA, windows, q/k norms), prefix caching included."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(HERE / "paged_attention_checks.py")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "paged attention checks passed" in proc.stdout
    assert proc.stdout.count("equals generate on") == 4
    assert proc.stdout.count("prefix cache") == 1
