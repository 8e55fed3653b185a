"""The continuous-batching engine: requests join and leave the running batch at every step
(iteration-level scheduling, as in Orca and vLLM).

One `step()` has three parts, each in its own module: the `Scheduler` decides which requests run
and how many tokens each gets (every decoding request one token, prompt chunks of at most
`prefill_chunk` tokens in lane order: chunked prefill keeps running streams getting a token
every step), asking the `KVCacheManager` for their blocks; the `ModelRunner` executes that plan
in one forward pass and samples, over its `InputBatch` of per-row state; then the scheduler
advances each request (`update_from_output`: computed tokens, published blocks, the sampled
token appended) and the engine turns each sampled token into what the request produced
(detokenize, stop strings, finish, logprobs). Every request the engine holds ends with exactly
one final output, whatever raises: a failed forward pass fails the requests in it, a failure
while handling one request's token fails that request only. The engine is single-threaded by
design: its owner calls add/cancel/step from one thread. The one exception is structured output's
schema compiles, which run on threads of their own (grammar_compile.py): a request with a grammar
waits beside the batch and joins it at the first step after its grammar is ready.

Prefix caching (`EngineConfig.prefix_caching`, on by default; block_pool.py,
kv_cache_manager.py): KV blocks of earlier requests' contexts stay in the pool after they end
and a request whose context starts the same way takes them instead of computing them. Each
output reports the prompt tokens its request took from the cache (`StepOutput.cached_tokens`),
and the engine keeps the hit rate (`prefix_cache_queries` / `prefix_cache_hits`). It is exact
for every family the engine accepts, sliding windows included: a block's KV depends only on the
tokens up to it, and the engine keeps every block of a context (a window only masks what
attention reads), so a shared block holds what the request would have computed itself.
"""

from __future__ import annotations

import logging
import time

import torch

from shared.errors import ErrorCode
from shared.protocol import MAX_TOP_LOGPROBS
from shared.sampling import invalid_control
from worker.engine import attention, row_kernels
from worker.engine.block_pool import prefix_root
from worker.engine.config import EngineConfig
from worker.engine.detokenize import IncrementalDetokenizer
from worker.engine.grammar import Compile, GrammarRefused, Grammars
from worker.engine.grammar_compile import Waiting
from worker.engine.kv_cache import PagedKVCache, kv_blocks, model_kv_shape
from worker.engine.kv_cache_manager import KVCacheManager
from worker.engine.logprobs import TokenText, entry as logprob_entry, prompt_echo
from worker.engine.model_support import check_supported
from worker.engine.quantize import Int4Linear
from worker.engine.runner import ModelRunner
from worker.engine.sampling import make_generator, skip
from worker.engine.scheduler import Scheduler, StepPlan
from worker.engine.sequence import Sequence
from worker.engine.shared_prefix import SharedPrefixes
from worker.engine.threads import StepThreads
from worker.engine.types import EngineRejected, EngineRequest, FinishReason, StepOutput  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

def eos_token_ids(model, tokenizer) -> set[int]:
    """Every id that ends generation: the tokenizer's EOS and the generation config's (which may
    list several, e.g. chat models' end-of-turn tokens)."""
    ids: set[int] = set()
    for value in (getattr(tokenizer, "eos_token_id", None),
                  getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig):
        check_supported(model.config)
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        attention.register()
        model.set_attn_implementation(attention.ATTN_IMPLEMENTATION)
        layers, kv_heads, head_dim = model_kv_shape(model.config)
        text_config = model.config.get_text_config()
        param = next(model.parameters())
        self.device = torch.device(config.device)
        if param.device.type != self.device.type or param.dtype != config.dtype:
            raise ValueError(f"model is on {param.device}/{param.dtype}, engine config says "
                             f"{config.device}/{config.dtype}")
        self.cache = PagedKVCache(layers=layers, num_blocks=kv_blocks(config, layers, kv_heads, head_dim),
                                  block_size=config.kv_block_size,
                                  kv_heads=kv_heads, head_dim=head_dim, dtype=config.dtype, device=config.device,
                                  prefix_caching=config.prefix_caching)
        # the root of every request's block names: what makes KV differ for the same token ids
        quantized = any(isinstance(m, Int4Linear) for m in model.modules())
        self._cache_root = prefix_root(getattr(model.config, "_name_or_path", ""), str(config.dtype),
                                       "int4" if quantized else "none", config.kv_block_size)
        if config.prefix_caching:
            log.info("prefix caching on: %d KV blocks of %d tokens, cached blocks reused for new tokens "
                     "least recently used first", self.cache.num_blocks, config.kv_block_size)
        self.kv = KVCacheManager(self.cache.pool, config.kv_block_size)
        self._shared = SharedPrefixes(tokenizer, config.shared_prefixes)   # every cache scope shares these
        self.scheduler = Scheduler(self.kv, config.max_batch, config.prefill_chunk, config.lane_aging_steps)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self._logits_width = model.get_output_embeddings().out_features   # a seeded token's noise
        # compiles requests' grammars (on its own threads), applies their masks in the runner
        # (stop ids read at the first compile, from the runner's eos_ids)
        self.grammars = Grammars(tokenizer, self._logits_width, lambda: self.eos_ids, config.max_batch, self.device,
                                 config.grammar)
        if config.row_kernels and self.device.type == "cpu":
            row_kernels.install(model)   # before the decoder loop picks its norms
        self.runner = ModelRunner(model, self.cache, groups=text_config.num_attention_heads // kv_heads,
                                  max_batch=config.max_batch, max_tokens=config.max_batch + config.prefill_chunk,
                                  max_positions=config.max_seq_len, device=self.device,
                                  dtype=config.dtype, cuda_graphs=config.cuda_graphs, grammars=self.grammars,
                                  threads=StepThreads(torch.get_num_threads(), config.wide_threads,
                                                      config.wide_from_tokens))
        self.eos_ids = eos_token_ids(model, tokenizer)
        self._by_rid: dict[str, Sequence] = {}
        # requests waiting for their grammar (worker.engine.grammar_compile): they join at a step
        # once it is compiled, or are refused (too large, invalid, past the compile timeout)
        self._compiling = Waiting()
        self._token_text = TokenText(tokenizer)   # logprobs: tokens as text
        self._finals: list[StepOutput] = []   # reported by the next step(), before any forward pass
        self._arrivals = 0
        # the last forward pass, for the worker's metrics: (rows, prompt tokens computed, decode
        # rows, tokens sampled); None when step() ran none
        self.last_step: tuple[int, int, int, int] | None = None

    # ---- public API -------------------------------------------------------------------

    @property
    def eos_ids(self) -> set[int]:
        """Token ids that end a request (and that `ignore_eos` requests never sample)."""
        return self.runner.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: set[int]) -> None:
        self.runner.eos_ids = set(ids)

    @property
    def has_work(self) -> bool:
        """Requests to run, finals to report or grammars being compiled (step() then waits for one)."""
        return bool(self._by_rid or self._finals or self._compiling)

    def ready(self) -> bool:
        """Whether step() has something to do now without waiting for a compile: what a driver that
        must stay responsive (worker.engine_thread) steps on, waking on `on_compiled`."""
        return bool(self._by_rid or self._finals) or self._compiling.any_ready()

    def compile_deadline(self) -> float | None:
        """time.monotonic() by which the next compile is refused if not done (None: none pending)."""
        return self._compiling.deadline()

    def compile_of(self, rid: str) -> Compile | None:
        """The compile a request waits for (None: it is not waiting for one)."""
        return self._compiling.get(rid)

    def on_compiled(self, notify) -> None:
        """`notify()` is called (in a compile thread) whenever a compile ends."""
        self.grammars.compile_pool.on_done = notify

    def take_grammar_records(self) -> tuple[list[float], list[str]]:
        """Compile seconds and refusal reasons since the last take (the worker's metrics)."""
        return self.grammars.compile_pool.take_records()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._compiling)

    def request_ids(self) -> list[str]:
        """Ids of every request the engine holds (compiling, waiting or running)."""
        return list(self._by_rid) + self._compiling.rids()

    @property
    def kv_tokens_total(self) -> int:
        """Tokens the KV pool holds (allocated at start-up)."""
        return self.cache.tokens_total

    @property
    def kv_tokens_used(self) -> int:
        """Tokens of the pool held by requests now (whole blocks)."""
        return self.cache.tokens_used

    @property
    def kv_tokens_cached(self) -> int:
        """Tokens of the pool that no request holds but that keep a cached prefix (they count
        as free: new tokens evict them when no plain free block is left)."""
        return self.cache.tokens_cached

    @property
    def preemptions(self) -> int:
        """Requests sent back to recompute because the KV pool ran out (total)."""
        return self.scheduler.preemptions

    @property
    def prefix_cache_queries(self) -> int:
        """Context tokens of requests admitted for the first time (total): the hit rate's denominator."""
        return self.kv.prefix_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of `prefix_cache_queries`, the tokens taken from the prefix cache instead of computed (total)."""
        return self.kv.prefix_hits

    @property
    def max_model_len(self) -> int:
        """Prompt + output tokens one request may use (what vLLM calls max_model_len)."""
        return min(self.config.max_seq_len, self.cache.tokens_total)

    def add(self, req: EngineRequest) -> None:
        """Queue a request, or raise EngineRejected if it can never run. A request with a grammar
        waits for it to compile (off this thread) and joins at a later step."""
        p = req.params
        if req.rid in self._by_rid or req.rid in self._compiling:
            raise EngineRejected(ErrorCode.DUPLICATE_ID, f"request {req.rid!r} is already in the engine")
        if not req.prompt_ids:
            raise EngineRejected(ErrorCode.INVALID_REQUEST, "empty prompt")
        context = list(req.prompt_ids) + list(req.generated_ids)
        if min(context) < 0 or max(context) >= self.vocab_size:
            raise EngineRejected(ErrorCode.INVALID_REQUEST, "token id outside the vocabulary")
        if p.max_tokens < 1 or p.temperature < 0 or not 0 < p.top_p <= 1 or p.top_k < 0 or req.skip_tokens < 0:
            raise EngineRejected(ErrorCode.INVALID_REQUEST, "invalid sampling parameters")
        if (bad := invalid_control(p)) is not None:
            raise EngineRejected(ErrorCode.INVALID_REQUEST, f"{bad[0]} {bad[1]}", param=bad[0])
        for name, ids in (("stop_token_ids", p.stop_token_ids), ("logit_bias", p.logit_bias or ())):
            if any(i >= self._logits_width for i in ids):
                raise EngineRejected(ErrorCode.INVALID_REQUEST, f"{name}: token id outside the vocabulary", param=name)
        for k in (p.logprobs, p.prompt_logprobs):
            if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                raise EngineRejected(ErrorCode.INVALID_REQUEST, f"logprobs must be 0 to {MAX_TOP_LOGPROBS}")
        if req.priority not in ("interactive", "batch"):
            raise EngineRejected(ErrorCode.INVALID_REQUEST, f"unknown priority {req.priority!r}")
        need = len(req.prompt_ids) + p.max_tokens
        limit = self.max_model_len
        if need > limit:
            raise EngineRejected(
                ErrorCode.CONTEXT_TOO_LONG,
                f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({p.max_tokens}) = {need} exceeds "
                f"the {limit} tokens one request may use",
            )
        if p.grammar is not None:
            self._compiling.add(req.rid, req, self.grammars.compile(p.grammar))
            return
        self._enter(req, None)

    def _enter(self, req: EngineRequest, matcher) -> None:
        """A checked request (with its grammar's matcher, if it has one) joins the scheduler."""
        p = req.params
        context = list(req.prompt_ids) + list(req.generated_ids)
        generator = None
        if p.temperature > 0 and p.seed is not None:
            generator = make_generator(p.seed, self.config.device)
            skip(generator, len(req.generated_ids), self._logits_width, self.device)
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, p.stop, skip_special_tokens=p.skip_special_tokens,
                                       include_stop=p.include_stop_str_in_output, min_tokens=p.min_tokens)
        salt = req.cache_salt.encode()
        seq = Sequence(req=req, detok=detok, generator=generator, arrival=self._arrivals, tokens=context,
                       cache_root=self._cache_root, cache_salt=salt, grammar=matcher,
                       salt_at=self._shared.salted_from(req.prompt_ids, self.config.kv_block_size) if salt else 0)
        self._arrivals += 1
        if not req.generated_ids and not req.skip_tokens:   # nothing delivered yet: the prompt goes first
            seq.echo = p.echo
            seq.prompt_lp_k = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        if seq.top_logprobs >= 0:   # with echo, offsets count from the echoed prompt's start (vLLM's)
            seq.text_offset = self._token_text.length(req.generated_ids) + \
                (self._token_text.length(req.prompt_ids) if p.echo else 0)
        for token in req.generated_ids:  # prime: what was released then counts as emitted now
            detok.add(token)
        self._by_rid[req.rid] = seq
        done = self._finish_reason(seq, self._ends(seq, req.generated_ids[-1])) if req.generated_ids else None
        if done is not None:  # the earlier run had already finished: only its final was lost
            self._forget(seq)
            self._finals.append(self._final(seq, detok.finish(), done))
            return
        self.scheduler.add(seq)

    def cancel(self, rid: str) -> bool:
        """Drop a waiting or running request now (its KV blocks are free for the next step); the next step() reports it with finish_reason "cancelled" before it runs the
        model, so a cancel is answered without waiting for a forward pass."""
        seq = self._by_rid.get(rid)
        if seq is None:
            req = self._compiling.drop(rid)
            if req is not None:
                self._finals.append(self._unentered(req, "cancelled"))
            return req is not None
        self._forget(seq)
        self._finals.append(self._final(seq, "", "cancelled"))
        return True

    def step(self) -> list[StepOutput]:
        """Pending finals (cancels, refusals) if there are any, else one scheduled forward pass and
        what each request produced. Requests whose grammar compiled join first; with nothing else
        to run, it waits for a compile (up to its deadline): a driver that must not wait steps
        only when `ready()`."""
        self.last_step = None
        if self._compiling:
            self._admit_compiled()
            if not self._by_rid and not self._finals and self._compiling:   # nothing else to do
                self._compiling.wait()
                self._admit_compiled()
        if self._finals:
            return self._take_finals()
        try:
            plan = self.scheduler.schedule()
        except Exception as exc:  # a bug: fail everything held rather than leak it
            log.exception("engine scheduling failed")
            self._fail(list(self._by_rid.values()), f"engine scheduling failed: {exc}")
            return self._take_finals()
        try:
            tokens = self.runner.execute(plan)   # an empty plan too: its requests' rows change
        except Exception as exc:  # e.g. CUDA OOM: fail this step's requests, keep the engine alive
            log.exception("engine step failed")
            self._fail(plan.scheduled, f"engine step failed: {exc}")
            return self._take_finals()
        if plan.empty:
            return self._take_finals()
        prompt_tokens = 0
        for seq, n in plan.prefill:   # O(prompt rows): the rows that can be newly admitted
            prompt_tokens += n
            if not seq.admitted_ms:
                seq.admitted_ms = int(time.time() * 1000)
        self.last_step = (len(plan.decode) + len(plan.prefill), prompt_tokens, len(plan.decode), len(tokens))
        return self._update(plan, tokens) + self._take_finals()

    # ---- internals --------------------------------------------------------------------

    def _admit_compiled(self) -> None:
        """Requests whose grammar is ready join the scheduler; refused ones end (a final)."""
        for req, job, now in self._compiling.take_ready():
            try:
                matcher = job.result(now)
                # a continuation: the grammar is where the delivered tokens left it
                if not all(matcher.accept(token) for token in req.generated_ids):
                    raise EngineRejected(ErrorCode.INVALID_REQUEST, "the delivered tokens do not follow the grammar")
                self._enter(req, matcher)
            except GrammarRefused as exc:
                self.grammars.compile_pool.count_refusal(exc.reason)
                self._finals.append(self._unentered(req, "error", ErrorCode.INVALID_REQUEST, f"{exc.param}: {exc}",
                                                    exc.param))
            except EngineRejected as exc:
                self._finals.append(self._unentered(req, "error", exc.code, exc.message, exc.param))
            except Exception as exc:  # a bug: this request fails, not the step
                log.exception("starting %s after its grammar compiled failed", req.rid)
                self._finals.append(self._unentered(req, "error", ErrorCode.INTERNAL,
                                                    f"could not start the request: {exc}"))

    def _unentered(self, req: EngineRequest, reason: FinishReason, code: ErrorCode | None = None,
                   message: str | None = None, param: str | None = None) -> StepOutput:
        """The final of a request that never joined the scheduler (its grammar was not ready)."""
        return StepOutput(rid=req.rid, text="", token_ids=[], finished=True, finish_reason=reason,
                          prompt_tokens=len(req.prompt_ids), completion_tokens=0, error_code=code,
                          error_message=message, error_param=param)

    def _update(self, plan: StepPlan, tokens: list[int]) -> list[StepOutput]:
        """The scheduler advances each scheduled request (computed tokens, published blocks,
        sampled tokens appended); then each sampled token becomes its request's output."""
        self.scheduler.update_from_output(plan, tokens)
        outputs = []
        now_ms = int(time.time() * 1000)   # one clock read per step, not per row
        logprobs = self.runner.last_logprobs
        for seq, rows in self.runner.last_prompt_rows or ():
            seq.prompt_rows.extend(rows)
        for i, (seq, token) in enumerate(zip(plan.sampled, tokens)):
            if seq.finished:
                continue
            try:
                out = self._on_token(seq, token, now_ms)
                if logprobs is not None and logprobs[i] is not None:
                    self._add_logprobs(seq, token, logprobs[i], out)
                if (seq.echo or seq.prompt_lp_k >= 0) and out is not None and out.token_ids:
                    out.prompt = prompt_echo(seq, self._token_text, self.tokenizer)
            except Exception as exc:  # e.g. the tokenizer raised: fail this request only
                log.exception("handling a token of %s failed", seq.req.rid)
                self._fail([seq], f"engine failed on a token: {exc}")
                continue
            if out is not None:
                outputs.append(out)
        return outputs

    def _ends(self, seq: Sequence, token: int) -> bool:
        """Whether `token` is an end-of-sequence token for this request (or one of its stop_token_ids)."""
        return (token in self.runner.eos_ids and not seq.ignore_eos) or token in seq.stop_ids

    def _finish_reason(self, seq: Sequence, eos: bool) -> FinishReason | None:
        """Why the request ends after its latest token (`eos`: that token ends sequences), if it does."""
        if eos or seq.detok.stopped or (seq.grammar is not None and seq.grammar.done):
            return "stop"
        if seq.completion_tokens >= seq.max_tokens:
            return "length"
        return None

    def _on_token(self, seq: Sequence, token: int, now_ms: int) -> StepOutput | None:
        """One sampled token (already appended to the request's context): its text, whether it
        ends the request, and what to report."""
        eos = self._ends(seq, token)
        if seq.grammar is not None and not eos and not seq.grammar.accept(token):
            raise RuntimeError(f"sampled token {token} breaks the request's grammar")
        if eos:   # the ending token's own text only where asked (vLLM's include_stop_str_in_output)
            text = (seq.detok.add(token) if seq.include_stop else "") + seq.detok.finish()
        else:
            text = seq.detok.add(token)
        reason = self._finish_reason(seq, eos)
        if reason is not None:
            if reason == "length" or (not eos and seq.grammar is not None and seq.grammar.done):
                text += seq.detok.finish()
            self._forget(seq)
        n = seq.completion_base + seq.new_tokens
        ids = [token]
        if n <= seq.skip_tokens:   # delivered by an earlier run: generated again, not emitted
            if reason is None:
                return None
            text, ids = "", []
        if reason is None:
            return StepOutput(seq.rid, text, ids, False, None, seq.prompt_len, n, None, None, now_ms)
        return StepOutput(seq.rid, text, ids, True, reason, seq.prompt_len, n, None, None, now_ms,
                          min(seq.cached_tokens, seq.prompt_len), seq.admitted_ms)

    def _add_logprobs(self, seq: Sequence, token: int, row: tuple, out: StepOutput | None) -> None:
        """The token's logprobs onto its output (a token an earlier run delivered only moves the
        text offset on)."""
        offset = seq.text_offset
        seq.text_offset += len(self._token_text(token))
        if out is not None and out.token_ids:
            out.logprobs = [logprob_entry(self._token_text, token, row, offset)]

    def _fail(self, seqs: list[Sequence], message: str) -> None:
        for seq in seqs:
            if not seq.finished:
                self._forget(seq)
                self._finals.append(self._final(seq, "", "error", ErrorCode.INTERNAL, message))

    def _forget(self, seq: Sequence) -> None:
        """The request leaves the engine: its KV blocks are free (exactly once)."""
        seq.finished = True
        self.scheduler.remove(seq)
        self.runner.remove(seq)
        self._by_rid.pop(seq.rid, None)

    def _take_finals(self) -> list[StepOutput]:
        finals, self._finals = self._finals, []
        return finals

    def _final(self, seq: Sequence, text: str, reason: FinishReason, code: ErrorCode | None = None,
               message: str | None = None) -> StepOutput:
        return StepOutput(rid=seq.rid, text=text, token_ids=[], finished=True, finish_reason=reason,
                          prompt_tokens=seq.prompt_len, completion_tokens=seq.completion_tokens,
                          error_code=code, error_message=message, cached_tokens=min(seq.cached_tokens, seq.prompt_len),
                          admitted_ms=seq.admitted_ms)
