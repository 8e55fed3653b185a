"""How far the CPU speed settings (DTYPE=bfloat16, QUANTIZATION=int4) move SmolLM2's outputs from
float32's, measured three ways in one run:

- teacher forcing: the same token sequences through float32 and each variant; per position, does
  the variant's top token equal float32's (top-1 agreement), KL(float32 || variant) (mean, p99,
  max, in nats), and each one's perplexity of the text. This is llama.cpp's own quantization
  yardstick (`llama-perplexity --kl-divergence`). Text: the first paragraphs of this repository's
  docs, and float32's own greedy answers to chat prompts (scored on the answer tokens only);
- greedy answers to the chat prompts: how many equal float32 `generate`'s, and where each first
  differs. Coarse: one flip at a near tie changes the rest of an answer, so it counts near ties
  as much as real damage; the per-position figures above separate the two;
- the engine against `generate` on the same variant (batched, chunked prefill), the equality the
  test suite checks on tiny models, here on the real one;
- failover: a continuation from the first third of each engine answer (prompt + delivered
  tokens prefilled, as a worker taking over a killed one's request runs it) against the
  uninterrupted answer: whether the client's text is what it would have been without the kill.

    .venv/bin/python bench/quality.py                       # float32 vs bfloat16 and int4, ~4 min
    .venv/bin/python bench/quality.py --variants int4 --tokens 32
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import percentile, table, write_json  # noqa: E402
from shared.config import Settings  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402
from worker.engine import Engine, EngineConfig, EngineRequest, build_prompt_ids, load_model  # noqa: E402

VARIANTS = {"float32": dict(dtype="float32"), "bfloat16": dict(dtype="bfloat16"), "int4": dict(quantization="int4")}

CHAT = ["What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child in simple words.",
        "List three fruits and their colours.", "Give me a short recipe for pancakes.", "Why is the sky blue?",
        "What is 12 times 7?", "Name a famous painter and one of his works.", "How do plants make food?",
        "Translate 'good morning' into Spanish.", "What is a prime number?", "Suggest a name for a pet cat."]
DOCS = ["README.md", "docs/operations.md", "docs/failover.md", "docs/protocol.md", "docs/transport.md",
        "docs/clients.md"]


def load(variant: str, threads: int):
    model, tok = load_model(Settings(torch_threads=threads, **VARIANTS[variant]))
    model.set_attn_implementation("sdpa")
    return model, tok


def greedy(model, tok, prompts: list[list[int]], n: int) -> list[list[int]]:
    """`generate`'s greedy answers (EOS ends one, as a chat user would see it)."""
    out = []
    with torch.inference_mode():
        for ids in prompts:
            seq = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
            out.append(seq)
    return out


def engine_greedy(model, tok, prompts: list[list[int]], n: int, rows: int,
                  delivered: list[list[int]] | None = None) -> list[list[int]]:
    """The same answers through the engine: `rows` at a time, 16-token prefill chunks, so steps
    mix prompt chunks with decode rows. With `delivered`, each request is a failover
    continuation (docs/failover.md): those tokens are context, and only the rest comes out."""
    engine = Engine(model, tok, EngineConfig(max_batch=rows, max_seq_len=1024, prefill_chunk=16,
                                             dtype=model.model.embed_tokens.weight.dtype))
    outs: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        engine.add(EngineRequest(f"q{i}", ids, SamplingParams(max_tokens=n, temperature=0.0),
                                 generated_ids=list(delivered[i]) if delivered else []))
    while engine.has_work:
        for o in engine.step():
            outs.setdefault(o.rid, []).extend(o.token_ids)
    return [outs.get(f"q{i}", []) for i in range(len(prompts))]


def failover_repeats(model, tok, prompts: list[list[int]], answers: list[list[int]], n: int, rows: int,
                     cut: int) -> tuple[int, int]:
    """Of the engine's answers longer than `cut` tokens, how many a continuation from their first
    `cut` tokens (what a worker taking over after a kill runs) finishes with the same tokens."""
    long = [i for i, a in enumerate(answers) if len(a) > cut]
    rest = engine_greedy(model, tok, [prompts[i] for i in long], n, rows, [answers[i][:cut] for i in long])
    return sum(r == answers[i][cut:] for i, r in zip(long, rest)), len(long)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where a and b differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def log_probs(model, seq: list[int], start: int) -> torch.Tensor:
    """float32 log-softmax over the vocabulary at positions start-1 .. len-2 (predicting seq[start:])."""
    with torch.inference_mode():
        logits = model(torch.tensor([seq])).logits[0, start - 1:-1]
    return torch.log_softmax(logits.float(), -1)


def compare(ref: list[torch.Tensor], var: list[torch.Tensor], targets: list[list[int]]) -> dict:
    """Per-position top-1 agreement, KL(ref || var) and perplexities over all sequences."""
    agree, kls, nll_ref, nll_var = 0, [], 0.0, 0.0
    count = 0
    for r, v, t in zip(ref, var, targets):
        idx = torch.tensor(t)
        agree += int((r.argmax(-1) == v.argmax(-1)).sum())
        kls += (r.exp() * (r - v)).sum(-1).clamp_min(0).tolist()
        nll_ref -= float(r.gather(1, idx[:, None]).sum())
        nll_var -= float(v.gather(1, idx[:, None]).sum())
        count += len(t)
    return {"positions": count, "top1_agree_pct": 100 * agree / count, "kl_mean": sum(kls) / count,
            "kl_p99": percentile(kls, 99), "kl_max": max(kls), "ppl_float32": math.exp(nll_ref / count),
            "ppl": math.exp(nll_var / count)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="bfloat16,int4", help=f"compared with float32; of {', '.join(VARIANTS)}")
    ap.add_argument("--tokens", type=int, default=48, help="greedy answer length")
    ap.add_argument("--doc-tokens", type=int, default=256, help="tokens of each docs file scored")
    ap.add_argument("--rows", type=int, default=4, help="engine batch for the engine-vs-generate check")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}")

    model, tok = load("float32", args.threads)
    prompts = [build_prompt_ids(tok, None, [{"role": "user", "content": q}]) for q in CHAT]
    answers = greedy(model, tok, prompts, args.tokens)
    # scored text: docs (from their second token) and float32's answers after each chat prompt
    seqs = [(tok.encode((ROOT / d).read_text())[: args.doc_tokens], 1) for d in DOCS]
    seqs += [(p + a, len(p)) for p, a in zip(prompts, answers) if a]
    targets = [s[start:] for s, start in seqs]
    reference = [log_probs(model, s, start) for s, start in seqs]
    rows = []
    base_engine = engine_greedy(model, tok, prompts, args.tokens, args.rows)
    cut = args.tokens // 3
    same, total = failover_repeats(model, tok, prompts, base_engine, args.tokens, args.rows, cut)
    rows.append({"variant": "float32", "top1 agree %": 100.0, "KL mean": 0.0, "KL p99": 0.0, "KL max": 0.0,
                 "ppl": compare(reference, reference, targets)["ppl"],
                 "greedy = float32": f"{len(CHAT)}/{len(CHAT)}", "first differences": "",
                 "engine = generate": f"{sum(a == b for a, b in zip(base_engine, answers))}/{len(CHAT)}",
                 "failover = uninterrupted": f"{same}/{total}"})
    results = {"float32": rows[0]}
    del model
    for name in variants:
        model, tok = load(name, args.threads)
        stats = compare(reference, [log_probs(model, s, start) for s, start in seqs], targets)
        mine = greedy(model, tok, prompts, args.tokens)
        diffs = [first_difference(a, b) for a, b in zip(mine, answers)]
        engine = engine_greedy(model, tok, prompts, args.tokens, args.rows)
        same, total = failover_repeats(model, tok, prompts, engine, args.tokens, args.rows, cut)
        row = {"variant": name, "top1 agree %": stats["top1_agree_pct"], "KL mean": stats["kl_mean"],
               "KL p99": stats["kl_p99"], "KL max": stats["kl_max"], "ppl": stats["ppl"],
               "greedy = float32": f"{diffs.count(None)}/{len(CHAT)}",
               "first differences": " ".join(str(d) for d in sorted(d for d in diffs if d is not None)),
               "engine = generate": f"{sum(a == b for a, b in zip(engine, mine))}/{len(CHAT)}",
               "failover = uninterrupted": f"{same}/{total}"}
        rows.append(row)
        results[name] = {**row, **stats, "first_differences": diffs}
        del model
    print(f"{sum(len(t) for t in targets)} scored positions ({len(DOCS)} docs x {args.doc_tokens} tokens, "
          f"{len(CHAT)} float32 answers); greedy answers of {args.tokens} tokens; failover after {cut}")
    print(table(rows, ["variant", "top1 agree %", "KL mean", "KL p99", "KL max", "ppl", "greedy = float32",
                       "first differences", "engine = generate", "failover = uninterrupted"]))
    print(f"results: {write_json('quality', {'args': vars(args), 'results': results})}")


if __name__ == "__main__":
    main()
