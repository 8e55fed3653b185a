"""4-bit weights for CPU workers (`QUANTIZATION=int4`): the decoder layers' linear projections
stored as 4-bit integers in groups of 32 with a scale and an offset per group, activations in bf16.
`QUANTIZATION=auto` (the default) picks it where it loses nothing the file had and runs fast: a
GGUF whose projections are all Q4_1 (`gguf_is_int4_exact`) on a CPU with native bf16
(`native_bf16_cpu`); see `config.settings_quantization`.

Why: a decode step of a few rows reads every weight once per token, so on a CPU it is bound by
weight bytes, not arithmetic. SmolLM2-135M in float32 reads ~540 MB a token (29-36 ms at batch 1
on the 2-core CI boxes, against llama.cpp's 6-11 ms on its 4-bit weights). torch ships a 4-bit
kernel for CPU (`aten._weight_int4pack_mm_for_cpu`, the one torchao and gpt-fast use); it is fast
with bf16 activations only, so a 4-bit model runs in bf16.

Faithful to the default model: SmolLM2's GGUF stores every projection as Q4_1, i.e. exactly this
layout (w = d * q + m per group of 32, q in 0..15). Loaded in float32, a group's smallest value
is m and its largest m + 15 d, so `Int4Linear.quantize` recovers the file's own q, d and m (the
reconstruction error on SmolLM2 is 0.0); only d and m are rounded to bf16. On weights that were
not 4-bit to begin with (a safetensors checkpoint) the same min/max rounding is ordinary
4-bit group quantization and loses accuracy, as llama.cpp's Q4_1 does.

The LM head: SmolLM2 ties it to the embeddings, which the GGUF keeps in 8 bits (Q8_0: w = d * s,
s in -127..127, one scale per 32 values). It is the largest matrix of a decode step (49152 x 576)
and in bf16 it cost as much as all 30 layers' 4-bit projections together (7.7 ms of a 26 ms token
on an EPYC without AMX). `Int8SplitLinear` keeps exactly the file's 8-bit values (recovered from
the float32 load, refused if they are not a Q8_0 grid) and runs them through the same 4-bit
kernel as two 4-bit planes side by side, s + 128 = 16 * hi + lo: half the bytes of bf16 and
2.3x faster there, and closer to the file than the bf16 copy (whose products d * s are rounded
to 8 bits of mantissa; here only d is). A copy with one int8 scale per row instead matched
float32's greedy answers on 7 of 12 chat prompts instead of 10: that is not what this does.
The embedding lookup keeps its bf16 table (one row per token read).

Large products (prefill chunks, big batches) are arithmetic, not bytes, and there the packed
kernels lose to the CPU's dense ones: each packed layer keeps a dense copy of its own numbers
(and the head borrows the tied embedding table) for products from a row count measured at start
on this CPU (`INT4_DENSE_ROWS`, cpu_kernels.py): 2x faster prefill on an EPYC without AMX, at
the cost of the dense copy's memory (214 MB for SmolLM2).

Exactness: the kernel computes each output row from that input row alone (the same bits whatever
else is in the batch), and weights are packed in independent blocks of 64 output rows, so a
fused q/k/v projection is the separate ones' packed rows side by side and gives the same bits
(checked in tests). The engine's batched, packed steps therefore equal `model.generate` on the
same 4-bit model wherever the bf16 attention does.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from worker.engine import cpu_kernels, q8_kernels

GROUP = 32                    # input features per scale/offset (llama.cpp's Q4 block size)
PACK_ROWS = 64                # the CPU packing's block of output rows (independent of the others)
INT4_DTYPE = torch.bfloat16   # activation dtype of a 4-bit model: the kernel's fast path
# the decoder layers' projections in a GGUF file (llama.cpp's names): what `quantize_int4` packs
GGUF_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def packable(out_features: int, in_features: int) -> bool:
    """Whether the kernel can hold a [out, in] weight: whole groups of inputs, whole packing blocks of rows."""
    return in_features % GROUP == 0 and out_features % PACK_ROWS == 0


# the decoder layer's projections that the decoder runs as one product each (they read the same
# input): decoder._Layer builds its products from these, and the kernel choices are timed on them
FUSED_PROJECTIONS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
                     ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))


def fused_groups(layer) -> list[list[torch.nn.Module]]:
    """`layer`'s projections in the groups of FUSED_PROJECTIONS."""
    return [[getattr(getattr(layer, part), name) for name in names] for part, names in FUSED_PROJECTIONS]


def join_rows(linears: list[torch.nn.Module], axes: tuple[tuple[str, int], ...]) -> list[torch.Tensor | None]:
    """The linears' tensors named in `axes` joined along their output rows (a copy; None where
    every linear has None)."""
    joined = []
    for name, axis in axes:
        parts = [getattr(lin, name) for lin in linears]
        if all(p is None for p in parts):
            joined.append(None)
        elif any(p is None for p in parts):
            raise ValueError(f"mixed projections with and without a {name} cannot be fused")
        else:
            joined.append(torch.cat([p.detach() for p in parts], axis))
    return joined


class Int4Linear(torch.nn.Module):
    """A drop-in `nn.Linear` (same forward) over 4-bit weights: `packed` (the CPU kernel's layout
    of q [out, in]) and `scales_zeros` [in / GROUP, out, 2], where w = (q - 8) * scale + zero."""

    # tensors and the axis their output rows lie on: a fused projection concatenates them there
    ROW_AXES = (("packed", 0), ("scales_zeros", 1), ("bias", 0), ("dense", 0),
                ("q8_packed", 0), ("q8_scales", 0), ("q8_zeros", 0))

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None,
                 in_features: int):
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)
        self.register_buffer("bias", bias)
        # the same weights dense (`with_dense`), for products of `dense_from_rows` rows or more
        self.register_buffer("dense", None)
        self.dense_from_rows = 0
        # the same weights in the 8-bit-activation kernel's layout (q8_kernels.py), for products
        # of fewer than `q8_below_rows` rows (`with_q8`)
        self.register_buffer("q8_packed", None)
        self.register_buffer("q8_scales", None)
        self.register_buffer("q8_zeros", None)
        self.q8_below_rows = 0
        self.in_features, self.out_features = in_features, scales_zeros.shape[1]

    @classmethod
    def quantize(cls, linear: torch.nn.Linear, dtype: torch.dtype = INT4_DTYPE, q8: bool = True) -> "Int4Linear":
        """Min/max rounding per group of 32 (asymmetric, like llama.cpp's Q4_1); `q8`: also keep
        the weights in the 8-bit-activation kernel's layout where it runs (`with_q8`)."""
        out_features, in_features = linear.weight.shape
        if not packable(out_features, in_features):
            raise ValueError(f"4-bit weights need in_features % {GROUP} == 0 and out_features % {PACK_ROWS} "
                             f"== 0; this linear is {in_features} -> {out_features}")
        groups = linear.weight.detach().to(torch.float32).view(out_features, in_features // GROUP, GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        step = (high - low) / 15
        step = torch.where(step > 0, step, torch.ones_like(step))
        q = torch.round((groups - low[..., None]) / step[..., None]).clamp_(0, 15)
        q = q.to(torch.int32).view(out_features, in_features)
        # the kernel's form: (q - 8) * scale + zero, so zero = low + 8 * step
        scales_zeros = torch.stack([step.t(), (low + 8 * step).t()], -1).to(dtype).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        made = cls(packed, scales_zeros, bias, in_features)
        if q8 and scales_zeros.dtype == torch.bfloat16 and q8_kernels.fits(in_features):
            # kept until the calibration says whether this CPU runs them faster (`with_q8`)
            made.q8_packed = q8_kernels.pack_q4(q)
            made.q8_scales = scales_zeros[..., 0].t().contiguous()
            made.q8_zeros = scales_zeros[..., 1].t().contiguous()
        return made

    @classmethod
    def joined(cls, linears: list["Int4Linear"]) -> "Int4Linear":
        """One projection over `linears` side by side (a copy of their 4-bit and 8-bit-activation
        tensors; not of a dense copy, which no timing of those kernels reads): the product the
        decoder runs for a fused group, for timing it as it runs."""
        axes = tuple(axis for axis in cls.ROW_AXES if axis[0] != "dense")
        packed, scales_zeros, bias, q8_packed, q8_scales, q8_zeros = join_rows(linears, axes)
        made = cls(packed, scales_zeros, bias, linears[0].in_features)
        made.q8_packed, made.q8_scales, made.q8_zeros = q8_packed, q8_scales, q8_zeros
        return made

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int4_linear(x, self.packed, self.scales_zeros, self.bias, self.dense, self.dense_from_rows,
                           self.q8, self.q8_below_rows)

    @property
    def q8(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        return None if self.q8_packed is None else (self.q8_packed, self.q8_scales, self.q8_zeros)

    def with_q8(self, below_rows: int) -> None:
        """Products of fewer than `below_rows` rows run on the 8-bit-activation kernel
        (q8_kernels.py); 0 drops its copy of the weights."""
        self.q8_below_rows = below_rows
        if not below_rows:
            self.q8_packed = self.q8_scales = self.q8_zeros = None

    def dequantized(self) -> torch.Tensor:
        """The weights the kernel multiplies by, [out, in] in the activations' dtype (read back
        through the kernel itself, so they are its numbers)."""
        eye = torch.eye(self.in_features, dtype=self.scales_zeros.dtype)
        return int4_linear(eye, self.packed, self.scales_zeros).t().contiguous()

    def with_dense(self, from_rows: int) -> None:
        """Keep a dense copy of the weights and multiply products of `from_rows` rows or more by
        it (the 4-bit kernel below that): see cpu_kernels.py."""
        self.dense, self.dense_from_rows = self.dequantized(), from_rows

    def extra_repr(self) -> str:
        dense = f", dense from {self.dense_from_rows} rows" if self.dense is not None else ""
        q8 = f", 8-bit activations {cpu_kernels.rows_shown(self.q8_below_rows)}" if self.q8_below_rows else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
                f"{q8}{dense}")


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
                bias: torch.Tensor | None = None, dense: torch.Tensor | None = None,
                dense_from_rows: int = 0, q8: tuple[torch.Tensor, ...] | None = None,
                q8_below_rows: int = 0) -> torch.Tensor:
    """x @ w.T (+ bias) for x [..., in] in the scales' dtype, w as `Int4Linear` stores it (or,
    for `dense_from_rows` rows or more, its `dense` copy of the same numbers; for fewer than
    `q8_below_rows`, its `q8` copy through the 8-bit-activation kernel). The decoder's
    activations are already a contiguous [T, in]: they go to the kernel with no reshape or view
    around it (each is a dispatch, and a 1-row decode step runs 4 projections a layer)."""
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if dense is not None and flat.shape[0] >= dense_from_rows:
        out = F.linear(flat, dense, bias)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], dense.shape[0])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if q8 is not None and flat.shape[0] < q8_below_rows:
        packed8, scales8, zeros8 = q8
        if not packed8.is_contiguous():   # a fused projection's part, seen by model.generate
            packed8, scales8, zeros8 = packed8.contiguous(), scales8.contiguous(), zeros8.contiguous()
        out = q8_kernels.q4_linear(flat, packed8, scales8, zeros8, bias)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], scales8.shape[0])
    if not scales_zeros.is_contiguous():
        # a fused projection's part, seen by model.generate: the kernel reads a strided view
        # wrongly (no error, wrong numbers), so it gets a copy
        scales_zeros = scales_zeros.contiguous()
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, GROUP, scales_zeros)
    if bias is not None:
        out = out + bias
    return out if x.dim() == 2 else out.view(*x.shape[:-1], scales_zeros.shape[1])


class Int8SplitLinear(torch.nn.Module):
    """A drop-in `nn.Linear` (no bias) over 8-bit weights in groups of 32 with one scale each
    (llama.cpp's Q8_0), run by the 4-bit kernel: u = s + 128 in 1..255 is split into two 4-bit
    planes u = 16 * hi + lo, laid side by side along the inputs, so that one product of [x, x]
    with [hi | lo] gives x @ w.T: w = 16d * (hi - 8) + (d * (lo - 8) + 8d) = d * s. Powers of two
    times bf16(d) are exact, so the weights multiplied are bf16(d) * s exactly."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, in_features: int):
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)
        self.in_features, self.out_features = in_features, scales_zeros.shape[1]

    @classmethod
    def from_q8_0(cls, weight: torch.Tensor, dtype: torch.dtype = INT4_DTYPE,
                  q8: bool = True) -> "Int8SplitLinear | None":
        """The layer for a float32 `weight` [out, in] that holds a Q8_0 tensor as loaded (every
        group of 32 is d * s with |s| <= 127 and its largest |s| = 127, as llama.cpp's quantizer
        leaves it); None when it does not (then nothing the file had would be kept exactly).
        `q8`: also keep those values in the 8-bit-activation kernel's layout where it runs."""
        out_features, in_features = weight.shape
        if not packable(out_features, in_features) or weight.dtype != torch.float32:
            return None
        groups = weight.detach().view(out_features, in_features // GROUP, GROUP)
        d = groups.abs().amax(-1) / 127
        d = torch.where(d > 0, d, torch.ones_like(d))
        s = groups / d[..., None]
        if not torch.equal(s, s.round()) or not torch.equal(s.round() * d[..., None], groups):
            return None
        u = (s.round() + 128).to(torch.int32).view(out_features, in_features)
        q = torch.cat([u >> 4, u & 15], 1)
        db = d.to(dtype)
        scales = torch.cat([db * 16, db], 1)
        zeros = torch.cat([torch.zeros_like(db), db * 8], 1)
        scales_zeros = torch.stack([scales.t(), zeros.t()], -1).contiguous()
        made = cls(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales_zeros, in_features)
        if q8 and db.dtype == torch.bfloat16 and q8_kernels.fits(in_features):
            made.q8_packed = q8_kernels.pack_q8(s.round().view(out_features, in_features))
            made.q8_scales = db.contiguous()
        return made

    # the file's 8-bit values as they are (q8_kernels.py) and their scales [out, in / 32], for
    # products of fewer than `q8_below_rows` rows (`with_q8`): plain attributes, kept or dropped
    # by the calibration
    q8_packed: torch.Tensor | None = None
    q8_scales: torch.Tensor | None = None
    q8_below_rows = 0

    def with_q8(self, below_rows: int) -> None:
        self.q8_below_rows = below_rows
        if not below_rows:
            self.q8_packed = self.q8_scales = None

    # a dense [out, in] weight for products of `dense_from_rows` rows or more (`with_dense`):
    # a plain attribute, not a buffer, since it is the tied embedding table's own tensor
    dense: torch.Tensor | None = None
    dense_from_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if self.dense is not None and flat.shape[0] >= self.dense_from_rows:
            out = F.linear(flat, self.dense)
        elif self.q8_packed is not None and flat.shape[0] < self.q8_below_rows:
            out = q8_kernels.q8_linear(flat if flat.is_contiguous() else flat.contiguous(), self.q8_packed,
                                       self.q8_scales)
        else:
            out = int4_linear(torch.cat([flat, flat], -1), self.packed, self.scales_zeros)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def with_dense(self, weight: torch.Tensor, from_rows: int) -> None:
        """Products of `from_rows` rows or more (a batched decode step's logits) multiply by the
        dense `weight` (the embedding table the head is tied to: no second copy): the 8-bit
        planes are the fast way for a few rows only, as the 4-bit projections."""
        self.dense, self.dense_from_rows = weight, from_rows

    def extra_repr(self) -> str:
        dense = f", dense from {self.dense_from_rows} rows" if self.dense is not None else ""
        q8 = f", 8-bit activations {cpu_kernels.rows_shown(self.q8_below_rows)}" if self.q8_below_rows else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, 8-bit groups of {GROUP}{q8}{dense}"


def quantize_int4(model, dtype: torch.dtype = INT4_DTYPE, dense_rows: int = 0, q8_rows: int = 0) -> None:
    """In place: every linear projection of the decoder layers becomes an `Int4Linear`, quantized
    from the weights as loaded (load in float32: then a Q4 GGUF's own values are recovered);
    a Q8_0 LM head becomes an `Int8SplitLinear`; every other floating parameter (embeddings,
    norms, a dense LM head) is cast to `dtype`. Buffers are
    left alone: the rotary inverse frequencies stay in float32, as transformers keeps them when
    it loads a model in bf16. `q8_rows`: products of fewer rows run on the 8-bit-activation
    kernels (q8_kernels.py) where they were built; -1 = timed here, 0 = never.
    Raises ValueError for a model whose shapes the kernel cannot hold."""
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("4-bit weights are for CPU workers (the kernel used here is torch's CPU one)")
    targets = [(module, name, child) for layer in model.model.layers for module in layer.modules()
               for name, child in module.named_children() if type(child) is torch.nn.Linear]
    # the 8-bit-activation copies only where they may be used (q8_rows 0: not even built)
    quantized = [Int4Linear.quantize(child, dtype, q8=q8_rows != 0) for _, _, child in targets]   # all or nothing
    for (parent, name, _), linear in zip(targets, quantized):
        setattr(parent, name, linear)
    # dense copies for large products (prefill chunks, big batches): from a row count timed here
    # on the model's own projections, or given (cpu_kernels.py); the tied 8-bit head the same way
    head_rows = dense_rows
    if dense_rows != 0:
        for linear in quantized:
            linear.with_dense(dense_rows)
        if dense_rows < 0:   # timed on the copies just made; none kept if dense never wins
            chosen = cpu_kernels.calibrate_projections(quantized, int4_linear, dtype)
            for linear in quantized:
                linear.dense, linear.dense_from_rows = (linear.dense, chosen) if chosen else (None, 0)
    head = getattr(model, "lm_head", None)
    if type(head) is torch.nn.Linear and head.bias is None:
        # a Q8_0 head (SmolLM2's tied embeddings) keeps its 8 bits; any other stays dense in `dtype`
        split = Int8SplitLinear.from_q8_0(head.weight, dtype, q8=q8_rows != 0)
        if split is not None:
            model.lm_head = split
            if head.weight is not model.get_input_embeddings().weight:
                head_rows = 0        # an untied head: no dense table to borrow
            elif head_rows < 0:
                head_rows = cpu_kernels.calibrate_head(split, head.weight.detach().to(dtype), quantized,
                                                       int4_linear, dtype)
    for param in model.parameters():
        if param.is_floating_point():
            param.data = param.data.to(dtype)
    if isinstance(model.lm_head, Int8SplitLinear) and head_rows > 0:
        model.lm_head.with_dense(model.get_input_embeddings().weight.detach(), head_rows)
    # llama.cpp's arithmetic (8-bit activations) for the fewest rows, where it is faster here
    split_head = model.lm_head if isinstance(model.lm_head, Int8SplitLinear) else None
    if q8_rows < 0 and all(linear.q8 is not None for linear in quantized):
        q8_rows, head_q8_rows = cpu_kernels.calibrate_q8(as_run(model, quantized), split_head, int4_linear,
                                                         q8_kernels.q8_linear, dtype)
    else:
        q8_rows = head_q8_rows = max(q8_rows, 0)
    for linear in quantized:
        linear.with_q8(q8_rows if linear.q8 is not None else 0)
    if split_head is not None:
        split_head.with_q8(head_q8_rows if split_head.q8_packed is not None else 0)


def as_run(model, quantized: list[Int4Linear]) -> list[Int4Linear]:
    """The 4-bit projections as a decode step multiplies them: each fused group joined into one
    (a temporary copy), so a timing sees the step's 120 products of SmolLM2 rather than 210
    smaller ones (the per-product cost differs by kernel: timed unfused, the 8-bit-activation
    kernel's step-level win at two threads, 1.18x, looked like 1.04x, and was refused). The
    projections one by one where a layer does not have the groups."""
    try:
        groups = [group for layer in model.model.layers for group in fused_groups(layer)]
    except AttributeError:
        return quantized
    if sorted(map(id, quantized)) != sorted(id(lin) for group in groups for lin in group):
        return quantized
    return [Int4Linear.joined(group) if len(group) > 1 else group[0] for group in groups]


def native_bf16_cpu(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX-BF16): there the 4-bit
    kernel's bf16 activations are fast. False where it cannot be told (no /proc/cpuinfo)."""
    return not cpu_kernels.cpu_flags(cpuinfo).isdisjoint(("avx512_bf16", "amx_bf16"))


@functools.lru_cache(maxsize=8)
def _gguf_projections_q4_1(path: str, mtime_ns: int) -> bool:
    from gguf import GGUFReader, GGMLQuantizationType
    projections = [t for t in GGUFReader(path).tensors
                   if t.name.startswith("blk.") and t.name.split(".")[-2] in GGUF_PROJECTIONS]
    # a GGUF shape is (in, out): ne0 first
    return bool(projections) and all(
        t.tensor_type == GGMLQuantizationType.Q4_1 and packable(int(t.shape[1]), int(t.shape[0])) for t in projections)


def gguf_is_int4_exact(path: str) -> bool:
    """Whether every decoder projection in the GGUF file at `path` is stored as Q4_1 in shapes
    the kernel packs: then `quantize_int4` recovers the file's own 4-bit values (only each
    group's scale and offset are rounded to bf16), and 4 bits lose nothing the file had."""
    return _gguf_projections_q4_1(path, os.stat(path).st_mtime_ns)


def kernel_path(model) -> str:
    """Which kernels this loaded model's products run on, by size, as the calibration (cpu_kernels.py, or
    a fixed INT4_DENSE_ROWS) chose them: for bench rows, beside `cpu_model()`. "dense" for a model
    with no 4-bit projections (fp32, bf16, a GPU)."""
    linears = [m for m in model.modules() if isinstance(m, Int4Linear)]
    if not linears:
        return "dense"
    rows = linears[0].dense_from_rows if linears[0].dense is not None else 0
    parts = [f"4-bit projections below {rows} rows, dense from {rows}" if rows else "4-bit projections at every size"]
    if linears[0].q8_below_rows:
        parts[0] += f" (8-bit activations {cpu_kernels.rows_shown(linears[0].q8_below_rows)})"
    head = getattr(model, "lm_head", None)
    if isinstance(head, Int8SplitLinear):
        parts.append(f"8-bit head below {head.dense_from_rows} rows, dense from {head.dense_from_rows}"
                     if head.dense is not None else "8-bit head at every size")
        if head.q8_below_rows:
            parts[-1] += f" (8-bit activations {cpu_kernels.rows_shown(head.q8_below_rows)})"
    return "; ".join(parts)
