"""Prefix caching: time to first token and prompt tokens computed when requests share a long
system prompt or resend a whole conversation, with the engine's prefix cache on and off (and
llama.cpp's server with `cache_prompt` as the peer), in one run.

Workloads (prompts built with the model's chat template, as the worker builds them):
  system  - --requests requests sharing one --system-tokens system prompt, each with its own
            short user message, answers of --answer-tokens (forced lengths). `sequential`: each
            request is sent when the previous one ended; `concurrent`: all at t=0. Reported: TTFT
            p50/p95 of requests 2..N (request 1 fills the cache), prompt tokens computed.
  chat    - --conversations conversations at once, --turns turns each: a turn resends the
            history (earlier messages and the answers the server gave) plus a new user message of
            about --user-tokens tokens; answers end at EOS or --chat-answer-tokens; the next turn
            is sent as soon as the answer ended. Reported per turn number: TTFT p50 over the
            conversations, prompt tokens and prompt tokens computed (mean per conversation).

Methods:
  engine-on / engine-off - worker.engine.Engine with the worker's default settings
                 (EngineConfig.from_settings: MAX_BATCH 16, PREFILL_CHUNK 256 on CPU, QUANTIZATION
                 auto) and PREFIX_CACHING true / false; a fresh engine (empty cache) per run
  llamacpp     - a running llama-server (--llamacpp-url), streaming /completion with
                 cache_prompt true, fed the same kind of token ids (one thread per client);
                 build and start it as bench/RESULTS.md says
  stack-1 / stack-2-routed / stack-2-unrouted - the whole service: a fresh Redis, 1 or 2
                 `python -m worker` processes (the same model, one torch thread each) and a
                 gateway with CACHE_ROUTING on or off; each client sends the same messages over
                 the WebSocket protocol. TTFT = `generate` sent -> first chunk received; prompt
                 tokens computed and the hit rate come from `done.usage.cached_tokens`. Answers
                 end at EOS or max_tokens (the protocol cannot force lengths).

Every run's prompts start with a fresh tag, so no run hits what an earlier one left in a cache
(llama.cpp's slots keep prompts between runs). Greedy decoding everywhere.

    .venv/bin/python bench/prefix.py --threads 2                        # engine on vs off
    .venv/bin/python bench/prefix.py --threads 2 --methods engine-on,engine-off,llamacpp \\
        --llamacpp-url http://127.0.0.1:8090
    .venv/bin/python bench/prefix.py --quick                            # smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import llamacpp_events, percentile, run_threads, table, write_json  # noqa: E402
from shared.config import Settings  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402
from worker.engine import Engine, EngineConfig, EngineRequest, build_prompt_ids, load_model  # noqa: E402
from worker.engine.quantize import Int4Linear  # noqa: E402

RULES = [
    "Answer the user's question directly and stay on topic.",
    "Prefer short paragraphs and plain words over jargon.",
    "When a question is ambiguous, state the reading you chose before answering.",
    "Never invent facts, names, numbers or sources; say when you do not know.",
    "Use the metric system unless the user asks for other units.",
    "Format lists with one item per line and keep each item brief.",
    "Refuse politely to help with anything dangerous or illegal, and explain why in one sentence.",
    "Keep the user's privacy: do not ask for personal details you do not need.",
    "If the user writes in another language, answer in that language.",
    "Show the steps of a calculation when the user asks for a number.",
    "Quote code in fenced blocks and name the language.",
    "Summaries come first; details and caveats after them.",
    "Be friendly but not chatty; no greetings unless the user greets you.",
    "When you give advice, mention the main risk or trade-off.",
    "Dates are written as year, month, day.",
]
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Why is the sky blue?",
    "Give me three tips for better sleep.", "What does a compiler do?", "How many legs does a spider have?",
    "Suggest a name for a grey cat.", "What is photosynthesis?", "Explain what an API is.",
    "How do I boil an egg?", "What is the boiling point of water?", "Name two planets with rings.",
    "What is a prime number?", "How do vaccines work?", "What causes tides?", "Translate 'thank you' to Spanish.",
]
TOPICS = ["the history of tea", "how bridges carry weight", "the life of honey bees", "why the moon has phases",
          "how a bicycle stays upright", "the water cycle", "how bread rises", "the first computers",
          "volcanoes and their eruptions", "how birds migrate", "the rules of chess", "how glass is made"]
FOLLOW_UPS = ["Tell me more about that, with one concrete example", "What is the most surprising fact about it",
              "How would you explain this to a ten year old child", "What did people believe about it long ago",
              "Which common mistakes do people make about it", "How is it different in other countries",
              "What would a scientist measure to study it", "Summarise what we discussed and add one new detail"]


def fit(tok, text: str, tokens: int) -> str:
    """`text` repeated or cut (at word boundaries) to about `tokens` tokens."""
    words = []
    while len(tok(" ".join(words), add_special_tokens=False)["input_ids"]) < tokens:
        words += text.split()
    while len(tok(" ".join(words), add_special_tokens=False)["input_ids"]) > tokens:
        words.pop()
    return " ".join(words)


@dataclass
class Turn:
    session: int
    turn: int
    prompt: list[int]
    submit: float = 0.0
    first: float | None = None
    end: float = 0.0
    text: str = ""
    computed: int | None = None   # prompt tokens the server computed (not taken from a cache)

    @property
    def ttft_ms(self) -> float:
        return 1000 * (self.first - self.submit)


@dataclass
class Session:
    """One client: its requests in order, each prompt built once the previous answer is known."""
    idx: int
    build: Callable[[list[str]], list[int] | None]   # answers so far -> next prompt (None: done)
    answers: list[str] = field(default_factory=list)
    # the same turn as chat messages (the stack methods send these; the worker renders them)
    build_messages: Callable[[list[str]], list[dict] | None] | None = None

    def next_prompt(self) -> list[int] | None:
        return self.build(self.answers)

    def next_messages(self) -> list[dict] | None:
        return self.build_messages(self.answers)


def system_sessions(tok, args, concurrent: bool) -> list[Session]:
    system = f"[{uuid.uuid4().hex[:8]}] You are a careful assistant. " + fit(
        tok, " ".join(f"Rule: {r}" for r in RULES), args.system_tokens)
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
             for i in range(args.requests)]
    prompts = [build_prompt_ids(tok, None, m) for m in chats]
    if concurrent:
        return [Session(i, lambda answers, p=p: None if answers else p,
                        build_messages=lambda answers, m=m: None if answers else m)
                for i, (p, m) in enumerate(zip(prompts, chats))]
    return [Session(0, lambda answers: prompts[len(answers)] if len(answers) < len(prompts) else None,
                    build_messages=lambda answers: chats[len(answers)] if len(answers) < len(chats) else None)]


def chat_sessions(tok, args) -> list[Session]:
    tag = uuid.uuid4().hex[:8]
    sessions = []
    for c in range(args.conversations):
        topic = TOPICS[c % len(TOPICS)]
        users = [fit(tok, f"[{tag}] I would like to learn about {topic}. Please explain how it works, where it "
                          f"comes from and why it matters to people today, in a few clear sentences.",
                     args.user_tokens) if k == 0 else
                 fit(tok, f"{FOLLOW_UPS[(k - 1) % len(FOLLOW_UPS)]}? Keep it about {topic}, and please be specific "
                          f"and clear in your answer.", args.user_tokens)
                 for k in range(args.turns)]

        def build_messages(answers: list[str], users=users) -> list[dict] | None:
            k = len(answers)
            if k == len(users):
                return None
            messages = []
            for j in range(k):
                messages += [{"role": "user", "content": users[j]}, {"role": "assistant", "content": answers[j]}]
            return messages + [{"role": "user", "content": users[k]}]

        def build(answers: list[str], build_messages=build_messages) -> list[int] | None:
            messages = build_messages(answers)
            return None if messages is None else build_prompt_ids(tok, None, messages)
        sessions.append(Session(c, build, build_messages=build_messages))
    return sessions


# ---- methods ---------------------------------------------------------------------------------

def run_engine(model, tok, sessions: list[Session], max_tokens: int, ignore_eos: bool, caching: bool,
               args) -> tuple[list[Turn], dict]:
    settings = Settings(device="cpu" if model.device.type == "cpu" else "cuda", prefix_caching=caching,
                        quantization=args.quantization, torch_threads=args.threads)
    config = EngineConfig.from_settings(settings)
    config.dtype = model.dtype
    engine = Engine(model, tok, config)
    live: dict[str, Turn] = {}
    done: list[Turn] = []

    def submit(session: Session) -> None:
        prompt = session.next_prompt()
        if prompt is None:
            return
        turn = Turn(session.idx, len(session.answers), prompt, submit=time.perf_counter())
        rid = f"s{session.idx}t{turn.turn}"
        live[rid] = turn
        engine.add(EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                 ignore_eos=ignore_eos))

    for session in sessions:
        submit(session)
    while live:
        outs = engine.step()
        stamp = time.perf_counter()
        for o in outs:
            turn = live[o.rid]
            if o.token_ids and turn.first is None:
                turn.first = stamp
            turn.text += o.text
            if o.finished:
                if o.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"{o.rid}: {o.finish_reason} {o.error_message}")
                turn.end, turn.computed = stamp, o.prompt_tokens - o.cached_tokens
                done.append(live.pop(o.rid))
                sessions[turn.session].answers.append(turn.text)
                submit(sessions[turn.session])
    model.set_attn_implementation("sdpa")
    counters = {"prefix_cache_queries": engine.prefix_cache_queries, "prefix_cache_hits": engine.prefix_cache_hits,
                "preemptions": engine.preemptions, "prefix_caching": config.prefix_caching}
    return done, counters


def run_llamacpp(url: str, sessions: list[Session], max_tokens: int, ignore_eos: bool) -> tuple[list[Turn], dict]:
    done: list[Turn] = []
    lock = threading.Lock()

    def client(session: Session) -> None:
        while (prompt := session.next_prompt()) is not None:
            turn = Turn(session.idx, len(session.answers), prompt)
            body = {"prompt": prompt, "n_predict": max_tokens, "ignore_eos": ignore_eos, "stream": True,
                    "cache_prompt": True, "temperature": 0.0, "top_k": 1, "samplers": ["top_k"]}
            turn.submit = time.perf_counter()
            for event in llamacpp_events(url, body):
                if turn.first is None and (event.get("content") or event.get("tokens")):
                    turn.first = time.perf_counter()
                turn.text += event.get("content", "")
                if event.get("stop"):
                    turn.end = time.perf_counter()
                    turn.computed = (event.get("timings") or {}).get("prompt_n")
            with lock:
                done.append(turn)
            session.answers.append(turn.text)

    run_threads(client, sessions)
    return done, {}


def run_stack(method: str, sessions: list[Session], max_tokens: int, args) -> tuple[list[Turn], dict]:
    """The whole service (see the module docstring): a fresh Redis, workers, a gateway."""
    import asyncio
    import tempfile

    from shared.localredis import LocalRedis
    from tests.gateway_client import GatewayClient
    from tests.stack_fixtures import _env, spawn, start_gateway, wait_for_worker

    workers = 1 if method == "stack-1" else 2
    routing = method != "stack-2-unrouted"
    logs = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    redis = LocalRedis().start()
    prefix = f"bp{uuid.uuid4().hex[:6]}"
    env = {"TORCH_THREADS": "1", "MAX_BATCH": "16", "QUANTIZATION": args.quantization, "DEVICE": "cpu",
           **({"MODEL_PATH": args.model_path} if args.model_path else {})}
    procs = [spawn("worker", _env(redis.url, prefix, {**env, "WORKER_ID": f"bench-w{i}"}), logs, f"w{i}")
             for i in range(workers)]
    done: list[Turn] = []
    try:
        for p in procs:
            wait_for_worker(redis.url, prefix, p, count=workers, timeout=300)
        gateway, base = start_gateway(redis.url, prefix, logs, env={"CACHE_ROUTING": str(routing).lower(),
                                                                     "HEARTBEAT_S": "0", "MAX_TOKENS_CAP": "4096"})
        url = base.replace("http", "ws") + "/v1/stream"
        totals = {"prompt": 0, "cached": 0}

        async def client(session: Session) -> None:
            c = await GatewayClient.connect(url)
            while (messages := session.next_messages()) is not None:
                turn = Turn(session.idx, len(session.answers), [], submit=time.perf_counter())
                cid = f"t{turn.turn}"
                await c.send(type="generate", id=cid, messages=messages, max_tokens=max_tokens, temperature=0)
                while True:
                    msg = await c.recv(cid, timeout=600)
                    if msg["type"] == "chunk":
                        if turn.first is None:
                            turn.first = time.perf_counter()
                        turn.text += msg["text"]
                    elif msg["type"] == "done":
                        break
                    elif msg["type"] == "error":
                        raise RuntimeError(f"refused: {msg}")
                if msg.get("finish_reason") not in ("stop", "length") or turn.first is None:
                    raise RuntimeError(f"turn ended {msg}")
                usage = msg["usage"]
                turn.end, turn.prompt = time.perf_counter(), [0] * usage["prompt_tokens"]
                turn.computed = usage["prompt_tokens"] - usage.get("cached_tokens", 0)
                totals["prompt"] += usage["prompt_tokens"]
                totals["cached"] += usage.get("cached_tokens", 0)
                done.append(turn)
                session.answers.append(turn.text)
            await c.close()

        async def all_clients() -> None:
            await asyncio.gather(*(client(s) for s in sessions))
        asyncio.run(all_clients())
        gateway.stop()
    finally:
        for p in procs:
            p.stop()
        redis.stop()
    return done, {"workers": workers, "routing": routing,
                  "hit_rate": totals["cached"] / totals["prompt"] if totals["prompt"] else 0.0}


def run(method: str, sessions: list[Session], max_tokens: int, ignore_eos: bool, model, tok, args):
    print(f"  {method} ...", flush=True)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    if method == "llamacpp":
        turns, counters = run_llamacpp(args.llamacpp_url, sessions, max_tokens, ignore_eos)
    elif method.startswith("stack"):
        turns, counters = run_stack(method, sessions, max_tokens, args)
    else:
        turns, counters = run_engine(model, tok, sessions, max_tokens, ignore_eos, method == "engine-on", args)
    counters["seconds"] = time.perf_counter() - t0
    counters["loadavg_1m"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    return sorted(turns, key=lambda t: (t.session, t.turn)), counters


# ---- workloads -------------------------------------------------------------------------------

def system_workload(mode: str, methods, model, tok, args) -> list[dict]:
    rows = []
    for method in methods:
        sessions = system_sessions(tok, args, concurrent=mode == "concurrent")
        turns, counters = run(method, sessions, args.answer_tokens, True, model, tok, args)
        order = sorted(turns, key=lambda t: t.submit)   # request 1 = the first one sent
        later = [t.ttft_ms for t in order[1:]]
        rows.append({"workload": f"system {mode}", "method": method, "requests": len(turns),
                     "prompt_tokens": sum(len(t.prompt) for t in turns),
                     "computed": sum(t.computed for t in turns if t.computed is not None),
                     "ttft_first_ms": order[0].ttft_ms, "ttft_p50_ms": percentile(later, 50),
                     "ttft_p95_ms": percentile(later, 95), "seconds": counters["seconds"],
                     "hit_rate": counters.get("hit_rate", counters.get("prefix_cache_hits", 0)
                                              / max(1, counters.get("prefix_cache_queries", 0))),
                     "loadavg_1m": counters["loadavg_1m"], "counters": counters,
                     "per_request": [{"ttft_ms": round(t.ttft_ms, 1), "prompt": len(t.prompt), "computed": t.computed}
                                     for t in order]})
        print(f"    TTFT p50 (2..{len(turns)}) {rows[-1]['ttft_p50_ms']:.0f} ms, computed {rows[-1]['computed']} "
              f"of {rows[-1]['prompt_tokens']} prompt tokens", flush=True)
    off = next((r for r in rows if r["method"] == "engine-off"), None)
    for row in rows:
        if off:
            row["off_p50_ratio"] = off["ttft_p50_ms"] / row["ttft_p50_ms"]
    return rows


def chat_workload(methods, model, tok, args) -> tuple[list[dict], dict]:
    per_method = {}
    for method in methods:
        turns, counters = run(method, chat_sessions(tok, args), args.chat_answer_tokens, False, model, tok, args)
        per_method[method] = {"counters": counters, "turns": [
            {"conversation": t.session, "turn": t.turn + 1, "prompt": len(t.prompt), "computed": t.computed,
             "ttft_ms": round(t.ttft_ms, 1), "answer_chars": len(t.text)} for t in turns]}
    rows = []
    for k in range(1, args.turns + 1):
        row = {"turn": k}
        for method, data in per_method.items():
            turns = [t for t in data["turns"] if t["turn"] == k]
            row[f"{method} prompt"] = sum(t["prompt"] for t in turns) / len(turns)
            row[f"{method} computed"] = sum(t["computed"] or 0 for t in turns) / len(turns)
            row[f"{method} TTFT p50"] = percentile([t["ttft_ms"] for t in turns], 50)
            if method.startswith("stack"):
                row[f"{method} hit"] = 1 - row[f"{method} computed"] / max(1, row[f"{method} prompt"])
        rows.append(row)
    return rows, per_method


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="", help="HF model dir or GGUF; default SmolLM2-135M-Instruct")
    ap.add_argument("--quantization", default="auto", choices=["auto", "none", "int4"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--methods", default="engine-on,engine-off")
    ap.add_argument("--workloads", default="system,chat")
    ap.add_argument("--llamacpp-url", default="")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--user-tokens", type=int, default=50)
    ap.add_argument("--chat-answer-tokens", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.system_tokens, args.answer_tokens = 4, 200, 4
        args.conversations, args.turns, args.user_tokens, args.chat_answer_tokens = 2, 3, 30, 16
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = [m for m in args.methods.split(",") if m]
    if "llamacpp" in methods and not args.llamacpp_url:
        ap.error("the llamacpp method needs --llamacpp-url")
    model, tok = load_model(Settings(model_path=args.model_path, device="cpu", quantization=args.quantization,
                                     torch_threads=args.threads))
    # warm-up outside the timings: the first calls of each shape allocate and pick kernels (a
    # long prompt in full chunks, then short prompts after a cached prefix, then decode rows)
    warm_args = argparse.Namespace(**{**vars(args), "requests": 3, "system_tokens": 600})
    if any(m.startswith("engine") for m in methods):
        for concurrent in (False, True):
            run_engine(model, tok, system_sessions(tok, warm_args, concurrent), 4, True, True, args)
    if "llamacpp" in methods:
        run_llamacpp(args.llamacpp_url, system_sessions(tok, warm_args, False), 4, True)

    workloads = [w for w in args.workloads.split(",") if w]
    system_rows, chat_rows, chat_detail = [], [], {}
    for w in workloads:
        if w == "system":
            for mode in ("sequential", "concurrent"):
                print(f"[system {mode}] {args.requests} requests, {args.system_tokens}-token system prompt", flush=True)
                system_rows += system_workload(mode, methods, model, tok, args)
        elif w == "chat":
            print(f"[chat] {args.conversations} conversations x {args.turns} turns", flush=True)
            chat_rows, chat_detail = chat_workload(methods, model, tok, args)
    print()
    if system_rows:
        print(table(system_rows, ["workload", "method", "requests", "prompt_tokens", "computed", "hit_rate",
                                  "ttft_first_ms", "ttft_p50_ms", "ttft_p95_ms", "off_p50_ratio", "seconds",
                                  "loadavg_1m"]))
        print()
    if chat_rows:
        print(table(chat_rows, list(chat_rows[0])))
        for method, data in chat_detail.items():
            ttft = {t["turn"]: [] for t in data["turns"]}
            for t in data["turns"]:
                ttft[t["turn"]].append(t["ttft_ms"])
            p50 = {k: percentile(v, 50) for k, v in ttft.items()}
            print(f"{method}: TTFT p50 turn {args.turns} / turn 1 = {p50[args.turns] / p50[1]:.2f}, "
                  f"{data['counters']}")
    name = args.model_path or "SmolLM2-135M-Instruct (GGUF)"
    if any(isinstance(m, Int4Linear) for m in model.modules()):
        name += ", int4 projections"
    path = write_json("prefix", {"model": f"{name} ({model.dtype})", "torch_threads": torch.get_num_threads(),
                                 "args": vars(args), "system": system_rows, "chat": chat_rows,
                                 "chat_detail": chat_detail})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
