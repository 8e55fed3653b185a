"""Throughput and latency of the continuous-batching engine against transformers' own ways of
serving the same requests, on the same model, prompts and arrival schedule, in one run.

Methods:
  a. sequential  - `model.generate`, one request at a time (FIFO)
  b. static      - `model.generate` on left-padded batches of up to --batch requests; a batch
                   starts when --batch requests wait or the oldest waited --static-wait s, and
                   runs until its longest request is done (a request arriving meanwhile waits)
  c. hf_cb       - transformers' continuous batching (`init_continuous_batching` manager,
                   requests added at their arrival times), where it works
  d. engine      - worker.engine.Engine, requests added at their arrival times
  e. llamacpp    - a running llama.cpp server (--llamacpp-url), fed the same token ids at the
                   same arrival times over its streaming /completion endpoint (one thread per
                   request); build and start it as bench/RESULTS.md says

Workloads:
  uniform - N requests, same output length, all arriving at t=0
  fixed   - for each --concurrency C: C requests of --fixed-prompt prompt tokens and
            --fixed-tokens output tokens, all at t=0, max_batch = C (GPU-shaped load)
  mixed   - N requests, output lengths log-uniform in [--min-tokens, --max-tokens] from a fixed
            seed, prompts of mixed length, Poisson arrivals at --rate requests/s

Output lengths are forced (EOS masked out of sampling everywhere: generate's min_new_tokens,
the engine's ignore_eos, llama.cpp's ignore_eos) so every method produces the same number of
tokens over comparable contexts. Set-up outside the timed region: the engine's KV cache allocation and the transformers
manager's start. Reported: output tokens/s (all tokens / time from first arrival to last token), TTFT
p50/p95 (first token - arrival, queueing included), inter-token gap p50/p95. Ratios are
against the static baseline of the same workload in the same run. Threads: with --threads 0
(the default) the engine runs as the worker runs it (worker.engine.threads: its narrow and wide
steps, libgomp's bounded spin) and the transformers methods on torch's default count;
--threads N gives every method N.

    .venv/bin/python bench/engine.py                       # SmolLM2-135M, ~5-6 min on 2 CPU cores
    .venv/bin/python bench/engine.py --quick               # small smoke run
    .venv/bin/python bench/engine.py --methods static,engine --workloads mixed
    .venv/bin/python bench/engine.py --methods engine,llamacpp --llamacpp-url http://127.0.0.1:8090
    .venv/bin/python bench/engine.py --device cuda --random-weights qwen2.5-0.5b --methods engine \
        --workloads fixed,mixed --concurrency 1,16,64,256

--random-weights builds a model of a real model's shape in code with random weights (no file,
no download; speed does not depend on weight values) and uses SmolLM2's tokenizer for prompts.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from worker.engine.threads import bound_openmp_spin  # noqa: E402

bound_openmp_spin()   # OpenMP as the worker's (before torch loads): what a user runs is measured

import torch  # noqa: E402
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList  # noqa: E402

from bench.common import llamacpp_events, percentile, run_threads, table, write_json  # noqa: E402
from shared.config import Settings  # noqa: E402
from worker.engine import Engine, EngineConfig, EngineRequest, build_prompt_ids, load_model  # noqa: E402
from worker.engine.config import default_prefill_chunk, resolve_dtype  # noqa: E402
from worker.engine.threads import apply_torch_threads, wide_torch_threads  # noqa: E402
from worker.engine.quantize import Int4Linear  # noqa: E402

try:
    from shared.sampling import SamplingParams
    from worker.engine.model_files import SMOLLM2_GGUF, smollm2_dir
except ImportError:   # a tree from before issue 33 (bench/engine_step.py --baseline-root imports this module there)
    from shared.streams import SamplingParams
    from worker.model_files import SMOLLM2_GGUF, smollm2_dir

# Real models' shapes, for --random-weights (from their published config.json files).
RANDOM_CONFIGS = {
    "smollm2-135m": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                                   max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5)),
    "qwen2.5-0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, rope_theta=1000000.0,
                                   max_position_embeddings=32768, tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "llama-3.2-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                                   max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-5,
                                   rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
}


def random_model(name: str, device: str, dtype: torch.dtype, tokenizer_dir: str = ""):
    """A model of `name`'s shape with random weights, built in code (no download), and
    SmolLM2's tokenizer (its ids fit every vocabulary above) for the prompts: from the GGUF, or
    from `tokenizer_dir` (SmolLM2's tokenizer saved with `save_pretrained`, for a machine that
    has neither the GGUF package nor `gguf`, such as a GPU box reached with a small upload)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    family, kwargs = RANDOM_CONFIGS[name]
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    torch.manual_seed(0)
    config = config_cls(**kwargs, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    with torch.device(device):
        model = model_cls(config).to(dtype)
    model.eval().requires_grad_(False)
    if tokenizer_dir:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    else:
        tok = AutoTokenizer.from_pretrained(str(smollm2_dir()), gguf_file=SMOLLM2_GGUF)
    return model, tok

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child in simple words.",
    "List three fruits and their colours.",
    "Give me a short recipe for pancakes.",
    "Why is the sky blue?",
]
CONTEXT = ("The history of the city spans many centuries. It began as a small fishing village on the "
           "river, grew into a market town, became a regional capital and finally an industrial centre "
           "with railways, factories, universities and museums. ")


@dataclass
class Req:
    idx: int
    arrival: float          # seconds after the start of the run
    prompt: list[int]
    n: int                  # output tokens to produce
    times: list[float] = field(default_factory=list)  # perf_counter of each output token


def make_workload(kind: str, tok, args) -> list[Req]:
    rng = random.Random(args.seed)
    chats = [build_prompt_ids(tok, None, [{"role": "user", "content": q}]) for q in QUESTIONS]
    if kind == "uniform":
        return [Req(i, 0.0, chats[i % len(chats)], args.uniform_tokens) for i in range(args.uniform_requests)]
    if kind.startswith("fixed"):  # fixed@C: C requests of exactly --fixed-prompt prompt tokens
        # each distinct from its first token, so no prefix cache (ours, llama.cpp's) serves any
        # of it: both sides compute every prompt, whatever their cache policy
        base = tok(CONTEXT * 8, add_special_tokens=False)["input_ids"]
        return [Req(i, 0.0, (tok(f"Request {i}: ", add_special_tokens=False)["input_ids"] + base)[: args.fixed_prompt],
                    args.fixed_tokens) for i in range(int(kind.split("@")[1]))]
    reqs, t = [], 0.0
    for i in range(args.mixed_requests):
        if i:
            t += rng.expovariate(args.rate)
        n = int(round(math.exp(rng.uniform(math.log(args.min_tokens), math.log(args.max_tokens)))))
        question = rng.choice(QUESTIONS)
        if rng.random() < 0.3:  # some long prompts (a few hundred tokens): chunked prefill matters
            question = CONTEXT * rng.randint(2, 6) + question
        reqs.append(Req(i, t, build_prompt_ids(tok, None, [{"role": "user", "content": question}]), n))
    return reqs


class StepClock(LogitsProcessor):
    """Records when generate() produces each token (called once per step, before sampling)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def _generate(model, tok, reqs: list[Req]) -> None:
    """One left-padded generate() call for `reqs`, to the longest one's length; each request
    keeps the timestamps of its own tokens."""
    width = max(len(r.prompt) for r in reqs)
    pad = tok.eos_token_id
    ids = torch.tensor([[pad] * (width - len(r.prompt)) + r.prompt for r in reqs], device=model.device)
    mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in reqs], device=model.device)
    steps = max(r.n for r in reqs)
    clock = StepClock()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                       do_sample=False, pad_token_id=pad, logits_processor=LogitsProcessorList([clock]))
    for r in reqs:
        r.times = clock.times[: r.n]


def _wait_until(t_abs: float) -> None:
    delay = t_abs - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


# Each method prepares outside the timed region (allocations, manager start-up) and returns
# (run(t0), cleanup()).

def _no_cleanup():
    pass


def prepare_sequential(model, tok, reqs, args):
    def run(t0):
        for r in sorted(reqs, key=lambda r: r.arrival):
            _wait_until(t0 + r.arrival)
            _generate(model, tok, [r])
    return run, _no_cleanup


def prepare_static(model, tok, reqs, args):
    return (lambda t0: _run_static(model, tok, reqs, args, t0)), _no_cleanup


def _run_static(model, tok, reqs, args, t0):
    queue = sorted(reqs, key=lambda r: r.arrival)
    while queue:
        now = time.perf_counter() - t0
        arrived = [r for r in queue if r.arrival <= now]
        if not arrived:
            _wait_until(t0 + queue[0].arrival)
            continue
        if len(arrived) < args.batch and now < arrived[0].arrival + args.static_wait and len(arrived) < len(queue):
            nxt = queue[len(arrived)].arrival
            _wait_until(t0 + min(nxt, arrived[0].arrival + args.static_wait))
            continue
        batch = arrived[: args.batch]
        for r in batch:
            queue.remove(r)
        _generate(model, tok, batch)


def prepare_hf_cb(model, tok, reqs, args):
    gc = GenerationConfig(max_new_tokens=max(r.n for r in reqs), do_sample=False, eos_token_id=-1,
                          pad_token_id=tok.eos_token_id)
    mgr = model.init_continuous_batching(generation_config=gc)
    mgr.start()

    def cleanup():
        mgr.stop(block=True, timeout=30)
        model.destroy_cached_continuous_batching_manager()
        model.set_attn_implementation("sdpa")

    def run(t0):
        pending = sorted(reqs, key=lambda r: r.arrival)
        by_id = {}
        done = 0
        while done < len(reqs):
            now = time.perf_counter() - t0
            while pending and pending[0].arrival <= now:
                r = pending.pop(0)
                rid = mgr.add_request(r.prompt, request_id=f"r{r.idx}", max_new_tokens=r.n,
                                      record_timestamps=True, eos_token_id=-1)
                if rid is None:
                    raise RuntimeError("manager refused a request")
                by_id[rid] = r
            timeout = 0.05 if not pending else max(0.001, min(0.05, t0 + pending[0].arrival - time.perf_counter()))
            res = mgr.get_result(timeout=timeout)
            if res is None:
                if not mgr.is_running():
                    raise RuntimeError("continuous batching thread stopped")
                continue
            if res.error:
                raise RuntimeError(res.error)
            if res.is_finished():
                r = by_id[res.request_id]
                r.times = list(res.timestamps or [])[: r.n]
                if len(r.times) != r.n:
                    raise RuntimeError(f"got {len(r.times)} timestamps for {r.n} tokens")
                done += 1
    return run, cleanup


def prepare_engine(model, tok, reqs, args):
    max_len = max(len(r.prompt) + r.n for r in reqs)
    torch.set_num_threads(args.narrow_threads)      # the worker's count below the wide steps
    engine = Engine(model, tok, EngineConfig(max_batch=_batch(reqs, args), max_seq_len=max_len,
                                             prefill_chunk=args.prefill_chunk or default_prefill_chunk(model.device.type),
                                             prefix_caching=args.prefix_cache == "on",
                                             device=str(model.device.type),
                                             dtype=model.dtype, wide_threads=args.wide_threads,
                                             wide_from_tokens=args.wide_from_tokens))

    def run(t0):
        pending = sorted(reqs, key=lambda r: r.arrival)
        by_rid = {}
        while pending or engine.has_work:
            now = time.perf_counter() - t0
            while pending and pending[0].arrival <= now:
                r = pending.pop(0)
                by_rid[str(r.idx)] = r
                engine.add(EngineRequest(str(r.idx), r.prompt, SamplingParams(max_tokens=r.n, **SAMPLING[args.sampling]),
                                         ignore_eos=True))  # forced lengths, as for the other methods
            if not engine.has_work:
                _wait_until(t0 + pending[0].arrival)
                continue
            outs = engine.step()
            stamp = time.perf_counter()
            for o in outs:
                by_rid[o.rid].times.extend([stamp] * len(o.token_ids))

    def cleanup():
        torch.set_num_threads(args.other_threads)
        model.set_attn_implementation("sdpa")
    return run, cleanup


# greedy: every method decodes the same tokens; chat: what chat clients typically send (the
# sampler's cost per row per step then counts, as it does in production)
SAMPLING = {"greedy": {"temperature": 0.0},
            "chat": {"temperature": 0.7, "top_p": 0.9},
            "default": {"temperature": 1.0}}


def _batch(reqs, args) -> int:
    """The fixed@C workload runs C requests at once; the others use --batch."""
    return len(reqs) if args.current_workload.startswith("fixed") else args.batch


def prepare_llamacpp(model, tok, reqs, args):
    """A running llama.cpp server (--llamacpp-url), one streaming /completion call per request
    at its arrival time; each token's arrival is stamped as it is read."""
    if not args.llamacpp_url:
        raise RuntimeError("--llamacpp-url is required for the llamacpp method")
    url = args.llamacpp_url

    def one(r: Req, t0: float):
        _wait_until(t0 + r.arrival)
        sampling = SAMPLING[args.sampling]
        body = {"prompt": r.prompt, "n_predict": r.n, "ignore_eos": True, "stream": True,
                "cache_prompt": args.prefix_cache == "on",      # the engine's policy (--prefix-cache)
                **({"temperature": 0.0, "top_k": 1, "samplers": ["top_k"]} if sampling["temperature"] == 0 else
                   {**sampling, "samplers": ["top_k", "top_p", "temperature"]})}
        for event in llamacpp_events(url, body):
            stamp = time.perf_counter()
            n = len(event.get("tokens") or []) or (1 if event.get("content") or not event.get("stop") else 0)
            r.times.extend([stamp] * n)
        del r.times[r.n:]
        if len(r.times) != r.n:
            raise RuntimeError(f"request {r.idx}: {len(r.times)} tokens of {r.n}")

    def run(t0):
        run_threads(lambda r: one(r, t0), reqs)
    return run, _no_cleanup


METHODS = {"sequential": prepare_sequential, "static": prepare_static, "hf_cb": prepare_hf_cb,
           "engine": prepare_engine, "llamacpp": prepare_llamacpp}


def summarize(reqs: list[Req], t0: float) -> dict:
    tokens = sum(len(r.times) for r in reqs)
    end = max(r.times[-1] for r in reqs)
    ttft = [r.times[0] - (t0 + r.arrival) for r in reqs]
    gaps = [b - a for r in reqs for a, b in zip(r.times, r.times[1:])]
    return {
        "output_tokens": tokens, "seconds": end - t0, "tok_s": tokens / (end - t0),
        "ttft_p50_ms": 1000 * percentile(ttft, 50), "ttft_p95_ms": 1000 * percentile(ttft, 95),
        "itl_p50_ms": 1000 * percentile(gaps, 50), "itl_p95_ms": 1000 * percentile(gaps, 95),
        "ttft_p99_ms": 1000 * percentile(ttft, 99), "itl_p99_ms": 1000 * percentile(gaps, 99),
    }


QUICK = {"static", "engine", "llamacpp"}


def measure(name: str, kind: str, model, tok, args) -> dict:
    args.current_workload = kind
    reqs = make_workload(kind, tok, args)
    print(f"[{kind}] {name}: {len(reqs)} requests, {sum(r.n for r in reqs)} output tokens ...", flush=True)
    load_before = os.getloadavg()[0]
    cleanup = _no_cleanup
    try:
        run, cleanup = METHODS[name](model, tok, reqs, args)
        t0 = time.perf_counter()
        run(t0)
        stats = summarize(reqs, t0)
    except Exception as exc:  # e.g. transformers' CB on an unsupported setup: record, go on
        stats = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        cleanup()
        model.set_attn_implementation("sdpa")
    stats["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(f"    {stats}", flush=True)
    return stats


def warm_up(model, tok, args):
    """First calls allocate and pick kernels; keep that out of every method's timing."""
    prompt = build_prompt_ids(tok, None, [{"role": "user", "content": "Hello"}])
    _generate(model, tok, [Req(0, 0, prompt, 4), Req(1, 0, prompt, 4)])
    engine = Engine(model, tok, EngineConfig(max_batch=2, max_seq_len=64, device=model.device.type, dtype=model.dtype))
    engine.add(EngineRequest("w", prompt, SamplingParams(max_tokens=4, temperature=0.0)))
    while engine.has_work:
        engine.step()
    model.set_attn_implementation("sdpa")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="", help="HF model dir; default SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--methods", default="sequential,static,hf_cb,engine")
    ap.add_argument("--workloads", default="uniform,mixed")
    ap.add_argument("--batch", type=int, default=16, help="static batch size = engine max_batch")
    ap.add_argument("--uniform-requests", type=int, default=16)
    ap.add_argument("--uniform-tokens", type=int, default=64)
    ap.add_argument("--mixed-requests", type=int, default=18)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--rate", type=float, default=2.0, help="mixed arrivals per second (Poisson)")
    ap.add_argument("--static-wait", type=float, default=0.5, help="static batcher's max wait to fill a batch (s)")
    ap.add_argument("--prefill-chunk", type=int, default=0, help="0 = the engine's default for the device "
                                                                "(256 on CPU, 8192 on CUDA)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="uniform workload: runs of the quick methods (static, engine); median reported")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", help="auto = bf16 on CUDA; on CPU fp32, or bf16 with the 4-bit "
                                                    "weights --quantization auto picks")
    ap.add_argument("--quantization", default="auto", choices=["auto", "none", "int4"],
                    help="int4: 4-bit projections, bf16 activations (CPU); auto: what a worker picks, int4 for "
                         "the Q4_1 GGUF on a CPU with native bf16 and --dtype auto (QUANTIZATION in "
                         "docs/operations.md)")
    ap.add_argument("--random-weights", default="", choices=["", *RANDOM_CONFIGS],
                    help="random weights in a real model's shape instead of the SmolLM2 GGUF")
    ap.add_argument("--tokenizer", default="", help="with --random-weights: a saved tokenizer directory "
                                                    "instead of SmolLM2's GGUF")
    ap.add_argument("--llamacpp-url", default="", help="a running llama-server for the llamacpp method")
    ap.add_argument("--prefix-cache", default="on", choices=["on", "off"],
                    help="the engine's prefix cache and llama.cpp's cache_prompt alike (the same policy on both "
                         "sides; the fixed workload's prompts are distinct anyway)")
    ap.add_argument("--concurrency", default="1,16,64,256", help="fixed workload: requests at once (= max_batch)")
    ap.add_argument("--fixed-prompt", type=int, default=128)
    ap.add_argument("--fixed-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run")
    ap.add_argument("--sampling", default="greedy", choices=list(SAMPLING),
                    help="the engine's and llama.cpp's sampling (static and hf_cb always decode greedily)")
    args = ap.parse_args()
    if args.quick:
        args.uniform_requests, args.uniform_tokens, args.mixed_requests, args.max_tokens = 4, 8, 6, 32
        args.fixed_prompt, args.fixed_tokens, args.concurrency = 16, 8, "1,4"
        args.repeat = 1

    # --threads 0: the engine under the worker's thread policy (worker.engine.threads), wide
    # steps included, and the model loaded (kernels calibrated) under it as the worker loads it;
    # the transformers methods keep torch's default threads
    args.other_threads = args.threads or torch.get_num_threads()
    policy = Settings(torch_threads=args.threads)
    args.wide_threads = wide_torch_threads(policy, args.device)
    args.wide_from_tokens = policy.torch_wide_from_tokens
    args.narrow_threads = apply_torch_threads(policy, args.device)
    if args.random_weights and args.quantization == "int4":
        ap.error("--quantization applies to the GGUF model, not --random-weights")
    if args.random_weights:
        model, tok = random_model(args.random_weights, args.device, resolve_dtype(args.dtype, args.device),
                                  args.tokenizer)
    else:
        settings = Settings(model_path=args.model_path, device=args.device, dtype=args.dtype,
                            quantization=args.quantization, torch_threads=args.threads)
        model, tok = load_model(settings)
    model.set_attn_implementation("sdpa")
    torch.set_num_threads(args.other_threads)
    warm_up(model, tok, args)
    methods = [m for m in args.methods.split(",") if m]
    rows, results = [], {}
    kinds = []
    for w in (w for w in args.workloads.split(",") if w):
        kinds += [f"fixed@{c}" for c in args.concurrency.split(",") if c] if w == "fixed" else [w]
    for kind in kinds:
        results[kind] = {}
        # On the (short) uniform workload the quick methods run `--repeat` times, alternating,
        # and report their median run: the machine is shared, and alternating exposes each
        # method to the same background load. Mixed-workload runs are long; they run once.
        repeat = args.repeat if kind == "uniform" else 1
        rounds = [[m for m in methods if m in QUICK or r == 0] for r in range(repeat)]
        runs: dict[str, list[dict]] = {}
        for round_methods in rounds:
            for name in round_methods:
                runs.setdefault(name, []).append(measure(name, kind, model, tok, args))
        for name in methods:
            ok = sorted((s for s in runs[name] if "tok_s" in s), key=lambda s: s["tok_s"])
            stats = dict(ok[len(ok) // 2]) if ok else runs[name][0]
            stats["runs"] = len(runs[name])
            if len(ok) > 1:
                stats["all_tok_s"] = [round(s["tok_s"], 1) for s in runs[name] if "tok_s" in s]
            results[kind][name] = stats
        base = results[kind].get("static", {})
        for name, stats in results[kind].items():
            row = {"workload": kind, "method": name, **stats}
            if "error" in row:
                row["error"] = row["error"][:60]
            if "tok_s" in stats and "tok_s" in base:
                row["x_static_tok_s"] = stats["tok_s"] / base["tok_s"]
                row["static_ttft_p95_ratio"] = base["ttft_p95_ms"] / stats["ttft_p95_ms"]
            rows.append(row)
    columns = ["workload", "method", "output_tokens", "seconds", "tok_s", "x_static_tok_s", "ttft_p50_ms",
               "ttft_p95_ms", "ttft_p99_ms", "static_ttft_p95_ratio", "itl_p50_ms", "itl_p95_ms", "itl_p99_ms", "runs", "loadavg_1m", "error"]
    print()
    print(table(rows, columns))
    model_name = (f"random {args.random_weights}" if args.random_weights
                  else args.model_path or "SmolLM2-135M-Instruct (GGUF, dequantized)")
    if any(isinstance(m, Int4Linear) for m in model.modules()):
        model_name += ", int4 projections"
    from worker.engine.cpu_kernels import cpu_model
    from worker.engine.quantize import kernel_path
    cpu, kernels = cpu_model(), kernel_path(model)
    print(f"CPU: {cpu}; engine torch threads: {args.narrow_threads} (wide steps: "
          f"{args.wide_threads or 'same'}), transformers methods: {args.other_threads}; "
          f"kernels: {kernels}")
    path = write_json("engine", {
        "baseline": "static", "model": f"{model_name} ({model.dtype})", "cpu": cpu, "kernels": kernels,
        "device": args.device, "torch_threads": args.narrow_threads, "wide_threads": args.wide_threads, "args": vars(args), "results": results,
        "rows": rows,
    })
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
