"""Checks of the paged decode kernel and of the engine paths that use it (CUDA graphs included),
runnable where the kernel runs: on a CUDA GPU, or on the CPU under Triton's interpreter
(TRITON_INTERPRET=1, which `tests/test_paged_attention.py` sets in a subprocess).

    python tests/paged_attention_checks.py            # CUDA if present, else the interpreter
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def patch_interpreter() -> None:
    """Triton 3.6's interpreter turns a loaded scalar into a loop bound with int() of a
    one-element array, which NumPy 2.4 refuses; take the element instead."""
    import numpy as np
    from triton.runtime import interpreter
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
    interpreter._patch_lang_tensor = patched


def reference(q, key_pool, value_pool, tables, table_rows, lengths, scale, window, block_size):
    """Float64 attention of each token's query over its request's positions [0, its length),
    read through the request's block table."""
    import torch
    outs = []
    groups = q.shape[1] // key_pool.shape[1]
    for r in range(q.shape[0]):
        length = int(lengths[r])
        pos = torch.arange(length)
        rows = tables[int(table_rows[r]), pos // block_size].long() * block_size + pos % block_size
        k = key_pool[rows].double().repeat_interleave(groups, 1)
        v = value_pool[rows].double().repeat_interleave(groups, 1)
        scores = torch.einsum("hd,lhd->hl", q[r].double(), k) * scale
        if window is not None:
            scores[:, pos < length - window] = float("-inf")
        outs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v))
    return torch.stack(outs)


def check_kernel(device, dtype) -> None:
    """The kernel against `reference` on fresh random inputs: grouped and plain heads, head sizes
    16/64/128, block sizes 8/16, windows, a step of decode rows (lengths from 1 to several tiles)
    and two prompt chunks (consecutive lengths over one table), a strided query (a view of a
    fused qkv), shuffled block tables in which half the requests start with the same blocks as
    the first one (prefix-cache hits: tables pointing at shared blocks). Every output element
    is written (poisoned first)."""
    import torch
    from worker.engine.paged_attention import paged_attention
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    generator = torch.Generator().manual_seed(1234)
    cases = [(9, 3, 64, 16, None), (4, 4, 16, 8, 5), (14, 2, 64, 16, 40), (8, 2, 128, 16, None), (4, 1, 16, 16, 300)]
    decode_lengths = [1, 17, 130, 64, 250, 2]
    chunks = [(0, 19), (100, 37)]    # (start, tokens) of two requests' prompt chunks
    for heads, kv_heads, dim, block_size, window in cases:
        blocks = 64
        lengths = torch.tensor(decode_lengths + [s + 1 + i for s, n in chunks for i in range(n)])
        table_rows = torch.tensor(list(range(len(decode_lengths)))
                                  + [len(decode_lengths) + j for j, (_, n) in enumerate(chunks) for _ in range(n)])
        width = -(-int(lengths.max()) // block_size)
        tables = torch.stack([torch.randperm(blocks, generator=generator)[:width]
                              for _ in range(len(decode_lengths) + len(chunks))]).to(torch.int32)
        shared = width // 2   # every other request, the first chunk's included, shares row 0's first blocks
        tables[1::2, :shared] = tables[0, :shared]
        key_pool = torch.randn(blocks * block_size, kv_heads, dim, generator=generator).to(dtype)
        value_pool = torch.randn(blocks * block_size, kv_heads, dim, generator=generator).to(dtype)
        qkv = torch.randn(len(lengths), heads + 2 * kv_heads, dim, generator=generator).to(dtype)
        q = qkv[:, :heads]
        out = torch.full((len(lengths), heads, dim), float("nan"), dtype=dtype, device=device)
        paged_attention(q.to(device), key_pool.to(device), value_pool.to(device), tables.to(device),
                        table_rows.to(device), lengths.to(device), dim ** -0.5, window, block_size, out=out)
        want = reference(q, key_pool, value_pool, tables, table_rows, lengths, dim ** -0.5, window, block_size)
        got = out.cpu().double()
        assert not got.isnan().any(), "unwritten output"
        err = float((got - want).norm() / want.norm())
        assert err < tol, (heads, kv_heads, dim, block_size, window, err)
        print(f"kernel {dtype} heads={heads}/{kv_heads} D={dim} block={block_size} window={window}: rel err {err:.2e}")


def check_engine(device) -> None:
    """On the kernel path, fp32: every family with its own attention quirks (GQA, windows, q/k
    norms) gives `generate`'s greedy tokens through the engine, 3 rows with a 4th request waiting
    for a free row; on CUDA, with graphs off and on (decode-only steps of 1-3 rows replay padded
    graphs)."""
    import torch
    from tests.engine_families import FAMILIES, PROMPTS, engine_tokens, reference
    prompts = PROMPTS + [[1, 9, 9, 9]]
    n = 24
    graph_modes = (False, True) if device == "cuda" else (False,)
    for name in ("llama", "qwen2-window", "qwen3", "mistral-window"):
        torch.manual_seed(0)
        model = FAMILIES[name]().eval().to(device)
        refs = [reference(model, p, n) for p in prompts]
        model.generation_config.eos_token_id = None
        for graphs in graph_modes:
            outs, engine = engine_tokens(model, prompts, n, max_batch=3, device=device, dtype=torch.float32,
                                         cuda_graphs=graphs)
            assert engine.runner.paged_kernel
            assert (engine.runner.graphs is not None) == graphs
            for i, ref in enumerate(refs):
                assert outs[f"r{i}"] == ref, (name, graphs, i, outs[f"r{i}"], ref)
            print(f"engine {name} fp32 graphs={graphs}: equals generate on {len(prompts)} prompts")


def check_prefix_engine(device) -> None:
    """On the kernel path, fp32, prefix caching on (a roomy pool and one that preempts) and off:
    requests whose block tables start with blocks other requests computed (shared 0, 1, many, all
    but the last token's), one cancelled mid-prefill, a continuation hitting generated blocks:
    each equals `generate` (`engine_families.assert_prefix_caching_exact`); on CUDA, graphs off and on."""
    import torch
    from tests.engine_families import FAMILIES, assert_prefix_caching_exact
    graph_modes = (False, True) if device == "cuda" else (False,)
    # the interpreter is slow: there one family, with a windowed and a full-attention layer
    for name in ("llama", "qwen2-window") if device == "cuda" else ("qwen2-window",):
        for graphs in graph_modes:
            torch.manual_seed(0)
            model = FAMILIES[name]().eval().to(device)
            assert_prefix_caching_exact(model, 12, name, device=device, dtype=torch.float32, cuda_graphs=graphs)
            print(f"prefix cache {name} fp32 graphs={graphs}: equals generate, cache on and off")


def check_graphs_bf16() -> None:
    """CUDA, bf16 (the GPU default): a graph replay computes what the eager step computes, so
    graphs on and off give the same greedy tokens on a model of SmolLM2's layout."""
    import torch
    from tests.engine_families import engine_tokens
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                                         num_attention_heads=3, num_key_value_heads=1, initializer_range=0.1,
                                         bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval().to("cuda", torch.bfloat16)
    model.generation_config.eos_token_id = None
    prompts = [[1, 5 + i, 70 + 3 * i, 9] * (1 + i % 5) for i in range(12)]
    eager, _ = engine_tokens(model, prompts, 40, max_batch=12, device="cuda", dtype=torch.bfloat16, cuda_graphs=False)
    graphed, engine = engine_tokens(model, prompts, 40, max_batch=12, device="cuda", dtype=torch.bfloat16,
                                    cuda_graphs=True)
    assert engine.runner.graphs is not None and engine.runner.graphs.sizes == [1, 2, 4, 8, 12]
    same = sum(eager[k] == graphed[k] for k in eager)
    assert same == len(prompts), f"{same}/{len(prompts)} requests equal"
    print(f"engine bf16: graphs on and off equal on {same}/{len(prompts)} requests")


def check_kv_sizing() -> None:
    """CUDA: by default the KV pool is MAX_BATCH x MAX_SEQ_LEN capped by a share of the free GPU
    memory; an explicit size that does not fit is refused at start-up with the sizes."""
    import torch
    from tests.engine_families import Tok
    from transformers import LlamaConfig, LlamaForCausalLM
    from worker.engine import Engine, EngineConfig
    from worker.engine.kv_cache import bytes_per_token, free_device_memory

    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval().to("cuda")
    per_token = bytes_per_token(2, 2, 16, torch.float32)
    share = free_device_memory(torch.device("cuda")) * 0.001
    tok = Tok()
    wants = int(share / per_token) * 4   # 4x what 0.1% of the free memory holds
    engine = Engine(model, tok, EngineConfig(max_batch=4, max_seq_len=wants // 4, device="cuda", dtype=torch.float32,
                                             kv_memory_fraction=0.001, cuda_graphs=False))
    assert share / per_token * 0.9 < engine.kv_tokens_total <= share / per_token * 1.1   # free memory moves a little
    del engine
    try:
        Engine(model, tok, EngineConfig(max_batch=4, max_seq_len=64, kv_cache_tokens=wants, device="cuda",
                                        dtype=torch.float32, kv_memory_fraction=0.001))
    except ValueError as exc:
        assert "KV_CACHE_TOKENS" in str(exc), exc
    else:
        raise AssertionError("an explicit KV pool larger than the GPU share was accepted")
    print(f"kv sizing: default capped at {share / 2**30:.2f} GiB, explicit oversize refused")


def main() -> None:
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("on a CPU, run with TRITON_INTERPRET=1")
        patch_interpreter()
    check_kernel(device, torch.float32)
    if device == "cuda":
        check_kernel(device, torch.bfloat16)
    check_engine(device)
    check_prefix_engine(device)
    if device == "cuda":
        check_graphs_bf16()
        check_kv_sizing()
    print("paged attention checks passed")


if __name__ == "__main__":
    main()
