"""Engine sizing knobs, kept apart from `shared.config.Settings` so the engine can be built in
tests and benchmarks without environment variables."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from worker.engine.grammar_compile import GrammarLimits
from worker.engine.threads import wide_torch_threads

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> str:
    """"auto" means CUDA when present, else CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """"auto" means bf16 on CUDA (fp16 on GPUs without bf16) and fp32 on CPU, where half
    precision matmuls are slow and lose accuracy for no gain."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def settings_quantization(settings, device: str) -> str:
    """"int4" or "none": QUANTIZATION, where "auto" (the default) means int4 when nothing is lost
    and much is gained: a CPU worker with DTYPE=auto on a CPU that multiplies bf16 natively,
    running a GGUF whose every decoder projection is Q4_1 in shapes the kernel packs (the shipped
    SmolLM2 is): the 4-bit kernel then runs the file's own values at a quarter of float32's bytes
    a token (sessions 15-16 under load: 0.5-0.86x llama.cpp's server in float32, 1.4-2.2x in int4).
    On a CPU without bf16 (AVX2 only) too, where the 8-bit-activation kernels run (q8_kernels.py,
    built, INT4_Q8_ROWS not 0): a decode step reads the 4-bit weights instead of float32's, 4.5x
    faster, for a 1.3x slower prefill (an AVX2-only CPU emulated on an AMD EPYC, bench/RESULTS.md).
    Anything else (a GPU, an explicit DTYPE, a float checkpoint) stays unquantized."""
    if settings.quantization != "auto":
        return settings.quantization
    if not device.startswith("cpu") or settings.dtype != "auto":
        return "none"
    from worker.engine.quantize import gguf_is_int4_exact, native_bf16_cpu
    from worker.engine.model_files import resolve_model
    if not native_bf16_cpu() and not _q8_kernels_run(settings):
        return "none"
    directory, gguf_file = resolve_model(settings.model_path, settings.model_gguf_file)
    return "int4" if gguf_file and gguf_is_int4_exact(str(Path(directory) / gguf_file)) else "none"


def _q8_kernels_run(settings) -> bool:
    """The 8-bit-activation kernels are wanted (INT4_Q8_ROWS not 0) and run on this CPU."""
    if settings.int4_q8_rows == 0:
        return False
    from worker.engine import q8_kernels
    return q8_kernels.load() is not None


def settings_dtype(settings, device: str) -> torch.dtype:
    """The dtype the model runs in under `settings`: DTYPE, except that 4-bit weights
    (QUANTIZATION=int4, CPU only) run bf16 activations, which is all their kernel is fast with."""
    if settings_quantization(settings, device) == "int4":
        if not device.startswith("cpu"):
            raise ValueError("QUANTIZATION=int4 is for CPU workers (DEVICE=cpu); on CUDA leave it at auto or none")
        if settings.dtype not in ("auto", "bfloat16"):
            raise ValueError(f"QUANTIZATION=int4 runs bfloat16 activations; DTYPE={settings.dtype} cannot be "
                             "combined with it (leave DTYPE at auto)")
        return torch.bfloat16
    return resolve_dtype(settings.dtype, device)


def default_prefill_chunk(device: str) -> int:
    """Prompt tokens a step takes when PREFILL_CHUNK is 0. On a CPU a step's time grows with its
    tokens, so a small chunk keeps running streams' inter-token gap short; on a GPU a step of a
    few thousand tokens costs little more than a decode step (the host's per-step work dominates
    a small model), so a large chunk cuts time to first token (H100, SmolLM2 shape, 256 prompts of
    128 tokens at once: 8192 gave 1.2-1.4x the tokens/s of 2048 and a third of the TTFT; RESULTS)."""
    return 8192 if device.startswith("cuda") else 256


@dataclass
class EngineConfig:
    max_batch: int = 16           # running requests (rows of a decode step)
    max_seq_len: int = 2048       # prompt + output tokens of one request
    kv_cache_tokens: int = 0      # KV pool size in tokens (allocated at start); 0 = max_batch * max_seq_len
    kv_block_size: int = 16       # tokens per KV block
    prefill_chunk: int = 256      # prompt tokens processed per step, interleaved with decode
    lane_aging_steps: int = 8     # a request starved this many steps is served as interactive
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    cuda_graphs: bool = True      # CUDA: replay decode-only steps as captured graphs
    row_kernels: bool = True      # CPU: norms and decode attention through worker.engine.row_kernels
    kv_memory_fraction: float = 0.85   # CUDA, kv_cache_tokens = 0: share of free GPU memory the pool may take
    prefix_caching: bool = True   # reuse the KV blocks of earlier requests' identical context prefixes
    shared_prefixes: tuple[str, ...] = ()   # prompt openings every cache scope shares (worker.engine.shared_prefix)
    grammar: GrammarLimits = field(default_factory=GrammarLimits)   # structured output's compile limits
    wide_threads: int = 0         # CPU: torch threads of a step of >= wide_from_tokens tokens (0: never change them)
    wide_from_tokens: int = 8

    def __post_init__(self):
        if (self.max_batch < 1 or self.max_seq_len < 2 or self.prefill_chunk < 1 or self.kv_cache_tokens < 0
                or self.lane_aging_steps < 1 or self.kv_block_size < 1 or not 0 < self.kv_memory_fraction <= 1):
            raise ValueError(f"invalid engine config: {self}")

    @property
    def num_blocks(self) -> int:
        """KV blocks to allocate: `kv_cache_tokens` rounded up to whole blocks, or by default
        room for `max_batch` requests of `max_seq_len` tokens (then nothing is ever preempted)."""
        if self.kv_cache_tokens:
            return -(-self.kv_cache_tokens // self.kv_block_size)
        return self.max_batch * -(-self.max_seq_len // self.kv_block_size)

    @classmethod
    def from_settings(cls, settings) -> "EngineConfig":
        device = resolve_device(settings.device)
        return cls(
            max_batch=settings.max_batch,
            max_seq_len=settings.max_seq_len,
            kv_cache_tokens=settings.kv_cache_tokens,
            kv_block_size=settings.kv_block_size,
            prefill_chunk=settings.prefill_chunk or default_prefill_chunk(device),
            lane_aging_steps=settings.lane_aging_steps,
            device=device,
            dtype=settings_dtype(settings, device),
            cuda_graphs=settings.cuda_graphs,
            row_kernels=settings.cpu_row_kernels,
            kv_memory_fraction=settings.kv_memory_fraction,
            prefix_caching=settings.prefix_caching,
            shared_prefixes=tuple(settings.cache_shared_prefixes),
            grammar=GrammarLimits.from_settings(settings),
            wide_threads=wide_torch_threads(settings, device),
            wide_from_tokens=settings.torch_wide_from_tokens,
        )
