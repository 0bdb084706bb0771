"""The continuous-batching scheduler: pure Python, no llama.cpp, testable with a fake vocab.

Contract (called only from the engine loop thread, in this order, once per step):
  schedule() -> StepPlan     which tokens of which slots go into this step's ONE batch
  update(plan, sampled)      feed back the token sampled for every row that wanted logits;
                             advances slots, applies stop rules, returns (request, event) pairs
  fail(plan, message)        the decode of that plan failed: its requests end with an error
Between steps the loop may call add(request) and abort(request_id).

One token budget per step (`max_num_batched_tokens`), spent in this order:
  1. one decode token for every slot generating (running streams never wait for a prefill);
  2. prompt chunks for slots still prefilling (chunked prefill: a long prompt spreads over steps);
  3. admission of waiting requests into idle slots, first come first served, while budget,
     slots and `max_num_seqs` last. A new request therefore waits one step, not a whole batch.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from localserve.engine.request import Request, RequestStatus, TokenEvent
from localserve.engine.slots import Slot, SlotPool, SlotState


class Vocab(Protocol):
    def piece(self, token: int) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...


@dataclass
class SeqChunk:
    """Consecutive tokens of one slot's sequence, placed at positions start_pos, start_pos+1, ..."""

    slot_id: int
    request: Request
    tokens: list[int]
    start_pos: int
    sample: bool  # logits for the last token are wanted: a token is sampled for this row


@dataclass
class StepPlan:
    chunks: list[SeqChunk] = field(default_factory=list)
    # slots newly given a request this step: (slot_id, request, tokens of old cache kept)
    admitted: list[tuple[int, Request, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)

    @property
    def num_decode_rows(self) -> int:
        return sum(1 for c in self.chunks if len(c.tokens) == 1 and c.sample
                   and c.start_pos >= c.request.num_prompt_tokens)

    def __bool__(self) -> bool:
        return bool(self.chunks)


@dataclass
class SchedulerStats:
    steps: int = 0
    tokens_batched: int = 0
    max_decode_rows_in_step: int = 0  # proof of sharing: >1 means streams decoded together
    requests_finished: int = 0
    requests_aborted: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0


class Scheduler:
    def __init__(self, pool: SlotPool, vocab: Vocab, max_num_batched_tokens: int,
                 max_num_seqs: int | None = None):
        if max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be at least 1")
        self.pool = pool
        self.vocab = vocab
        self.budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs or len(pool.slots)
        self.waiting: deque[Request] = deque()
        self.stats = SchedulerStats()

    # ---- between steps -------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.num_prompt_tokens >= self.pool.n_ctx_per_slot:
            raise ValueError(f"prompt of {request.num_prompt_tokens} tokens does not fit a slot "
                             f"of {self.pool.n_ctx_per_slot} tokens")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def abort(self, request_id: str) -> tuple[Request, TokenEvent] | None:
        """Drop a request wherever it is; its slot is free for the very next schedule()."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                return req, self._close(req, "abort")
        for slot in self.pool.slots:
            if slot.request is not None and slot.request.request_id == request_id:
                req = slot.request
                return req, self._end(slot, "abort")
        return None

    @property
    def running(self) -> list[Slot]:
        return [s for s in self.pool.slots if s.busy]

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s.busy for s in self.pool.slots)

    # ---- one step ------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.budget
        running = self.running
        for slot in running:
            if slot.state is SlotState.DECODE and budget > 0:
                budget -= self._add_chunk(plan, slot, budget)
        for slot in running:
            if slot.state is SlotState.PREFILL and budget > 0:
                budget -= self._add_chunk(plan, slot, budget)
        n_running = len(running)
        while self.waiting and budget > 0 and n_running < self.max_num_seqs:
            choice = self.pool.best_idle_slot(self.waiting[0].prompt_tokens)
            if choice is None:
                break
            slot, keep = choice
            req = self.waiting.popleft()
            slot.assign(req, keep)
            req.status = RequestStatus.RUNNING
            plan.admitted.append((slot.slot_id, req, keep))
            self.stats.prompt_tokens_cached += keep
            n_running += 1
            budget -= self._add_chunk(plan, slot, budget)
        return plan

    def _add_chunk(self, plan: StepPlan, slot: Slot, budget: int) -> int:
        pending = slot.pending_tokens()
        tokens = pending[:budget]
        plan.chunks.append(SeqChunk(slot.slot_id, slot.request, tokens, slot.n_cached,
                                    sample=len(tokens) == len(pending)))
        return len(tokens)

    def update(self, plan: StepPlan, sampled: dict[int, int]) -> list[tuple[Request, TokenEvent]]:
        self._count(plan)
        events = []
        for chunk in plan.chunks:
            slot = self.pool.slots[chunk.slot_id]
            if slot.request is not chunk.request:
                continue  # aborted while the step ran
            slot.cached.extend(chunk.tokens)
            if chunk.start_pos < chunk.request.num_prompt_tokens:
                self.stats.prompt_tokens_computed += min(
                    len(chunk.tokens), chunk.request.num_prompt_tokens - chunk.start_pos)
            if chunk.sample:
                events.append((chunk.request, self._accept_token(slot, sampled[chunk.slot_id])))
        return events

    def fail(self, plan: StepPlan, message: str) -> list[tuple[Request, TokenEvent]]:
        """A failed decode leaves those slots' caches unknown: forget them and end the requests."""
        events = []
        for chunk in plan.chunks:
            slot = self.pool.slots[chunk.slot_id]
            if slot.request is chunk.request:
                slot.cached.clear()
                events.append((chunk.request, self._end(slot, "error", error=message)))
        return events

    # ---- stop rules ----------------------------------------------------------------
    def _accept_token(self, slot: Slot, token: int) -> TokenEvent:
        req = slot.request
        slot.state = SlotState.DECODE
        req.output_tokens.append(token)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if self.vocab.is_eog(token) and not req.params.ignore_eos:
            return self._end(slot, "stop", token=token)
        text = slot.detokenizer.feed(self.vocab.piece(token))
        if slot.detokenizer.stopped:
            return self._end(slot, "stop", text, token)
        if req.num_output_tokens >= req.params.max_tokens or slot.n_cached >= slot.n_ctx:
            return self._end(slot, "length", text, token)
        return TokenEvent(text, (token,))

    def _end(self, slot: Slot, reason: str, text: str = "", token: int | None = None,
             error: str | None = None) -> TokenEvent:
        req = slot.request
        if reason in ("stop", "length") and slot.detokenizer is not None:
            text += slot.detokenizer.flush()
        slot.release()
        event = self._close(req, reason, error)
        event.text, event.token_ids = text, (() if token is None else (token,))
        return event

    def _close(self, req: Request, reason: str, error: str | None = None) -> TokenEvent:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if reason == "abort":
            self.stats.requests_aborted += 1
        else:
            self.stats.requests_finished += 1
        return TokenEvent("", finish_reason=reason, error=error,
                          prompt_tokens=req.num_prompt_tokens,
                          completion_tokens=req.num_output_tokens,
                          cached_tokens=req.cached_tokens)

    def _count(self, plan: StepPlan) -> None:
        self.stats.steps += 1
        self.stats.tokens_batched += plan.num_tokens
        rows = plan.num_decode_rows
        if rows > self.stats.max_decode_rows_in_step:
            self.stats.max_decode_rows_in_step = rows
