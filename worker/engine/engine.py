"""The continuous-batching engine: requests join and leave the running batch at every step
(iteration-level scheduling, as in Orca and vLLM).

One `step()` admits waiting requests into free KV slots (two lanes, token budget), packs one
token of every decoding request plus up to `prefill_chunk` prompt tokens of prefilling requests
into a single forward pass (chunked prefill: long prompts are split over several steps so
running streams keep getting a token every step), samples a token for every request that needs
one, and returns what each request produced. The engine is single-threaded by design: its owner
calls add/cancel/step from one thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from shared.errors import ErrorCode
from shared.streams import SamplingParams
from worker.engine import attention
from worker.engine.attention import PrefillChunk, StepMeta, additive_mask, prefill_mask
from worker.engine.config import EngineConfig
from worker.engine.detokenize import IncrementalDetokenizer
from worker.engine.kv_cache import SlotKVCache, model_kv_shape
from worker.engine.sampling import make_generator, sample
from worker.engine.scheduler import TokenBudget, WaitingQueue

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass
class EngineRequest:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: Literal["interactive", "batch"] = "interactive"
    skip_tokens: int = 0  # tokens already delivered by an earlier run: generated again, not emitted


class EngineRejected(Exception):
    """The request can never run here (the caller reports `code` to the client)."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class StepOutput:
    rid: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    error_code: ErrorCode | None = None
    error_message: str | None = None
    # wall clock (ms) when the step produced this output: outputs may reach Redis later, batched
    emitted_ms: int = field(default_factory=lambda: int(time.time() * 1000))


@dataclass
class _Sequence:
    """Engine-side state of one admitted or waiting request."""
    req: EngineRequest
    reserve: int
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    slot: int = -1
    computed: int = 0               # tokens whose K/V are in the cache
    output_ids: list[int] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.req.prompt_ids)

    @property
    def prefilled(self) -> bool:
        return self.computed >= self.prompt_len


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
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        attention.register()
        model.set_attn_implementation(attention.ATTN_IMPLEMENTATION)
        layers, kv_heads, head_dim = model_kv_shape(model.config)
        text_config = model.config.get_text_config()
        self._groups = text_config.num_attention_heads // kv_heads
        param = next(model.parameters())
        self.device = torch.device(config.device)
        if param.device.type != self.device.type or param.dtype != config.dtype:
            raise ValueError(f"model is on {param.device}/{param.dtype}, engine config says "
                             f"{config.device}/{config.dtype}")
        self.cache = SlotKVCache(layers=layers, slots=config.max_batch, kv_heads=kv_heads,
                                 max_seq_len=config.max_seq_len, head_dim=head_dim,
                                 dtype=config.dtype, device=config.device)
        self.budget = TokenBudget(config.token_budget)
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self._waiting: WaitingQueue[_Sequence] = WaitingQueue()
        self._by_rid: dict[str, _Sequence] = {}
        self._running: list[_Sequence] = []   # admission order
        self._finals: list[StepOutput] = []   # cancellations reported by the next step()
        # A 4D tensor makes transformers return it as the "mask" untouched instead of building
        # a causal mask over the packed sequence that slot attention would not read.
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)

    # ---- public API -------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self._running or len(self._waiting) or self._finals)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def request_ids(self) -> list[str]:
        """Ids of every request the engine holds (waiting or running)."""
        return list(self._by_rid)

    @property
    def kv_tokens_total(self) -> int:
        return self.budget.total

    @property
    def kv_tokens_used(self) -> int:
        return self.budget.used

    def add(self, req: EngineRequest) -> None:
        """Queue a request, or raise EngineRejected if it can never run."""
        p = req.params
        if req.rid in self._by_rid:
            raise EngineRejected(ErrorCode.DUPLICATE_ID, f"request {req.rid!r} is already in the engine")
        if not req.prompt_ids:
            raise EngineRejected(ErrorCode.INVALID_REQUEST, "empty prompt")
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= self.vocab_size:
            raise EngineRejected(ErrorCode.INVALID_REQUEST, "prompt token id outside the vocabulary")
        if p.max_tokens < 1 or p.temperature < 0 or not 0 < p.top_p <= 1 or p.top_k < 0 or req.skip_tokens < 0:
            raise EngineRejected(ErrorCode.INVALID_REQUEST, "invalid sampling parameters")
        if req.priority not in ("interactive", "batch"):
            raise EngineRejected(ErrorCode.INVALID_REQUEST, f"unknown priority {req.priority!r}")
        need = len(req.prompt_ids) + p.max_tokens
        limit = min(self.config.max_seq_len, self.budget.total)
        if need > limit:
            raise EngineRejected(
                ErrorCode.CONTEXT_TOO_LONG,
                f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({p.max_tokens}) = {need} exceeds "
                f"the {limit} tokens one request may use",
            )
        generator = make_generator(p.seed, self.config.device) if p.temperature > 0 else None
        seq = _Sequence(req=req, reserve=need, generator=generator,
                        detok=IncrementalDetokenizer(self.tokenizer, req.prompt_ids, p.stop))
        self._by_rid[req.rid] = seq
        self._waiting.push(req.priority, seq)

    def cancel(self, rid: str) -> bool:
        """Drop a waiting or running request now (its slot and budget are free for the next
        step); the next step() reports it with finish_reason "cancelled"."""
        seq = self._by_rid.get(rid)
        if seq is None:
            return False
        if seq.slot < 0:
            self._waiting.remove(seq)
            self._forget(seq)
        else:
            self._release(seq)
        self._finals.append(self._final(seq, "", "cancelled"))
        return True

    def step(self) -> list[StepOutput]:
        outputs, self._finals = self._finals, []
        self._admit()
        decode = sorted((s for s in self._running if s.prefilled), key=lambda s: s.slot)
        prefill: list[tuple[_Sequence, int]] = []
        room = self.config.prefill_chunk
        for seq in self._running:
            if room == 0:
                break
            if not seq.prefilled:
                n = min(seq.prompt_len - seq.computed, room)
                prefill.append((seq, n))
                room -= n
        if not decode and not prefill:
            return outputs
        try:
            sampled_seqs, token_ids = self._forward(decode, prefill)
        except Exception as exc:  # e.g. CUDA OOM: fail this step's requests, keep the engine alive
            log.exception("engine step failed")
            for seq in decode + [s for s, _ in prefill]:
                self._release(seq)
                outputs.append(self._final(seq, "", "error", ErrorCode.INTERNAL, f"engine step failed: {exc}"))
            return outputs
        for seq, token in zip(sampled_seqs, token_ids):
            out = self._on_token(seq, token)
            if out is not None:
                outputs.append(out)
        return outputs

    # ---- internals --------------------------------------------------------------------

    def _admit(self) -> None:
        while self.cache.num_free:
            seq = self._waiting.head()
            if seq is None or not self.budget.fits(seq.reserve):
                return
            self._waiting.pop()
            seq.slot = self.cache.allocate()
            self.budget.reserve(seq.reserve)
            self._running.append(seq)

    def _forward(self, decode: list[_Sequence], prefill: list[tuple[_Sequence, int]]):
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for seq in decode:
            last = seq.output_ids[-1]
            ids.append(last)
            pos.append(seq.computed)
            slots.append(seq.slot)
        keep = list(range(len(decode)))
        sampled = list(decode)
        chunks = []
        for seq, n in prefill:
            start = seq.computed
            ids.extend(seq.req.prompt_ids[start : start + n])
            pos.extend(range(start, start + n))
            slots.extend([seq.slot] * n)
            chunks.append(PrefillChunk(seq.slot, start, n, prefill_mask(start, n, self._groups, self.device, self.config.dtype)))
            if start + n == seq.prompt_len:
                keep.append(len(ids) - 1)
                sampled.append(seq)
        dev = self.device
        meta = StepMeta(
            cache=self.cache,
            write_slots=torch.tensor(slots, device=dev),
            write_pos=torch.tensor(pos, device=dev),
            num_decode=len(decode),
            prefills=chunks,
        )
        if decode:
            rows = decode[-1].slot + 1
            lengths = [1] * rows  # rows without a decode token attend to one position; ignored
            for seq in decode:
                lengths[seq.slot] = seq.computed + 1
            meta.rows = rows
            meta.max_len = max(lengths)
            if rows != len(decode):
                row_token = [0] * rows
                for i, seq in enumerate(decode):
                    row_token[seq.slot] = i
                meta.row_token = torch.tensor(row_token, device=dev)
                meta.decode_rows = torch.tensor([s.slot for s in decode], device=dev)
            span = torch.arange(meta.max_len, device=dev)
            allowed = span[None, :] < torch.tensor(lengths, device=dev)[:, None]
            meta.decode_mask = additive_mask(allowed, self.config.dtype).view(rows, 1, 1, -1)
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([ids], device=dev),
                position_ids=torch.tensor([pos], device=dev),
                attention_mask=self._no_mask,
                logits_to_keep=torch.tensor(keep or [len(ids) - 1], device=dev),
                use_cache=False,
                **{attention.META_KWARG: meta},
            )
            for seq in decode:
                seq.computed += 1
            for seq, n in prefill:
                seq.computed += n
            if not sampled:
                return [], []
            params = [s.req.params for s in sampled]
            tokens = sample(out.logits[0], [p.temperature for p in params], [p.top_k for p in params],
                            [p.top_p for p in params], [s.generator for s in sampled])
        return sampled, tokens

    def _on_token(self, seq: _Sequence, token: int) -> StepOutput | None:
        seq.output_ids.append(token)
        n = len(seq.output_ids)
        reason: FinishReason | None = None
        if token in self.eos_ids:
            reason = "stop"
            text = seq.detok.finish()
        else:
            text = seq.detok.add(token)
            if seq.detok.stopped:
                reason = "stop"
            elif n >= seq.req.params.max_tokens:
                reason = "length"
                text += seq.detok.finish()
        if reason is not None:
            self._release(seq)
        suppressed = n <= seq.req.skip_tokens
        if suppressed and reason is None:
            return None
        return StepOutput(
            rid=seq.req.rid, text="" if suppressed else text, token_ids=[] if suppressed else [token],
            finished=reason is not None, finish_reason=reason,
            prompt_tokens=seq.prompt_len, completion_tokens=n,
        )

    def _release(self, seq: _Sequence) -> None:
        self._running.remove(seq)
        self.cache.release(seq.slot)
        self.budget.release(seq.reserve)
        self._forget(seq)

    def _forget(self, seq: _Sequence) -> None:
        self._by_rid.pop(seq.req.rid, None)

    def _final(self, seq: _Sequence, text: str, reason: FinishReason, code: ErrorCode | None = None,
               message: str | None = None) -> StepOutput:
        return StepOutput(rid=seq.req.rid, text=text, token_ids=[], finished=True, finish_reason=reason,
                          prompt_tokens=seq.prompt_len, completion_tokens=len(seq.output_ids),
                          error_code=code, error_message=message)
