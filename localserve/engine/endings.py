"""How a request ends, the scheduler's fourth bookkeeper (beside PrefixBook, PoolKeeper and
DraftBook): each accepted token through the stop rules (stop_rules.after_token), and ending
one: its slot released, the final event with the counts billed, and the n > 1 siblings held
until the first choice's prompt is in cache let go (request.py: RequestStatus.HELD)."""

from __future__ import annotations

import logging
import time

from localserve.engine.finish import FinishReason
from localserve.engine.interfaces import Vocab
from localserve.engine.plan import StepPlan
from localserve.engine.request import Request, RequestStatus, TokenEvent
from localserve.engine.scheduler_stats import SchedulerStats
from localserve.engine.slots import Slot, SlotPool
from localserve.engine.stop_rules import after_token
from localserve.engine.waiting import FairQueue

log = logging.getLogger("localserve.scheduler")


class Endings:
    def __init__(self, vocab: Vocab, stats: SchedulerStats, waiting: FairQueue):
        self.vocab, self.stats, self.waiting = vocab, stats, waiting
        self.held: list[Request] = []  # RequestStatus.HELD: n > 1 siblings (see request.py)

    def accept(self, slot: Slot, token: int) -> TokenEvent:
        """A sampled token, through the stop rules. A bug in one request's stop rules or
        detokenizing ends that request alone."""
        try:
            return self._accept(slot, token)
        except Exception as exc:
            log.exception("request %s failed while handling its token",  # pragma: no mutate block
                          slot.request.request_id)
            return self.end(slot, FinishReason.ERROR, error=f"internal error in this request: {exc!r}")

    def _accept(self, slot: Slot, token: int) -> TokenEvent:
        req = slot.request
        req.output_tokens.append(token)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
            self.release_siblings(req)
        text, reason, stop_type = after_token(req, token, self.vocab, slot.n_cached, slot.n_ctx)
        if reason is None:
            return TokenEvent(text, (token,))
        return self.end(slot, reason, text, token, stop_type=stop_type)

    def end(self, slot: Slot, reason: FinishReason, text: str = "", token: int | None = None,
            error: str | None = None, stop_type: str = "none") -> TokenEvent:
        """A running request's end: its slot free for the next step."""
        req = slot.request
        if reason.completed and req.detokenizer is not None:
            text += req.detokenizer.flush()
        slot.release()
        event = self.close(req, reason, error)
        event.text, event.token_ids = text, (() if token is None else (token,))
        event.stop_type = stop_type
        return event

    def failed(self, plan: StepPlan, pool: SlotPool,
               why: dict[int, str]) -> list[tuple[Request, TokenEvent]]:
        """A failed decode leaves those slots' caches unknown: forget them and end the requests
        of the chunks in `why` (slot id -> the error they get)."""
        events = []
        for chunk in plan.chunks:
            slot = pool.slots[chunk.slot_id]
            if slot.request is chunk.request and chunk.slot_id in why:
                slot.forget()
                events.append((chunk.request, self.end(slot, FinishReason.ERROR,
                                                       error=why[chunk.slot_id])))
        return events

    def abort(self, request_id: str, pool: SlotPool, reason: FinishReason,
              error: str | None) -> tuple[Request, TokenEvent] | None:
        """Drop a request wherever it is (waiting, held or in a slot); None: not found."""
        for queued in (self.waiting, self.held):
            for req in queued:
                if req.request_id == request_id:
                    queued.remove(req)
                    return req, self.close(req, reason, error)
        for slot in pool.slots:
            if slot.request is not None and slot.request.request_id == request_id:
                return slot.request, self.end(slot, reason, error=error)
        return None

    def close(self, req: Request, reason: FinishReason, error: str | None = None) -> TokenEvent:
        """Any request's end, running or not: the final event, billed."""
        self.release_siblings(req)  # ended before its first token: they compute it themselves
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.stats.count_end(reason)
        billed = req.prefix_of is None  # n > 1: the prompt is counted once, on the first choice
        return TokenEvent("", finish_reason=reason, error=error,
                          prompt_tokens=req.num_prompt_tokens if billed else 0,
                          completion_tokens=req.num_output_tokens,
                          cached_tokens=req.cached_tokens if billed else 0)

    def release_siblings(self, first: Request) -> None:
        """HELD -> WAITING: the first choice's prompt is in cache (or it ended without it)."""
        for sibling in [r for r in self.held if r.prefix_of is first]:
            self.held.remove(sibling)
            sibling.status = RequestStatus.WAITING
            self.waiting.follow(sibling)
