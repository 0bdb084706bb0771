"""The continuous-batching scheduler: pure Python, no llama.cpp, testable with a fake vocab. Its
contract with the loop (one schedule() and one update() per step): interfaces.StepScheduler.

One token budget per step (`max_num_batched_tokens`), spent in this order: one decode token
for every slot generating; prompt chunks for slots still prefilling (chunked prefill); then
admission of waiting requests into idle slots (FairQueue order), while budget, slots,
`max_num_seqs` and cache room last. A new request therefore waits one step, not a batch.
The cache is one pool (slots.py, pool_keeper.py): a slot's share guaranteed, more borrowed, a
sequence preempted for room saved to the prompt cache and restored. Each concern is kept by a
bookkeeper the scheduler asks (reuse.py, pool_keeper.py, slot_shares.py: keys' shares; drafts,
grammar shares, long prompts); the invariants are written in schedule(), pinned by tests.
"""

from __future__ import annotations

import time

from localserve.engine.grammar_shares import CostlyGrammars, GrammarShares, too_costly
from localserve.engine.image_rows import chunk_length
from localserve.engine.interfaces import Vocab
from localserve.engine.long_prompts import (LongPromptPlaces, count_stopped, held_beside_a_chat,
                                            stopped_enough)
from localserve.engine.plan import Admission, Lanes, SeqChunk, StepOutput, StepPlan
from localserve.engine.pool_keeper import PoolKeeper
from localserve.engine.progress import prompt_progress
from localserve.engine.prompt_cache import PromptCache
from localserve.engine.reuse import DraftBook, Placement, PrefixBook
from localserve.engine.scheduler_stats import SchedulerStats
from localserve.engine.scheduler_view import PoolLimits, SchedulerView, limits_of, view_of
from localserve.engine.slot_shares import SlotShares
from localserve.engine.endings import Endings
from localserve.engine.finish import FinishReason
from localserve.engine.request import Request, RequestStatus, TokenEvent
from localserve.engine.slots import Slot, SlotPool, SlotState
from localserve.engine.waiting import FairQueue

# Background tasks' prompt tokens in a step beside chats, and a step's tokens with tasks only:
# a chat arriving meanwhile waits for a step this small, not a whole title prompt.
BACKGROUND_PREFILL_TOKENS = 64
BACKGROUND_STEP_TOKENS = 16
# A waiting request that cannot fit yet is passed by requests behind it that fit at most this
# many times; then the queue waits for it (invariant 11): counted in admissions, not time.
MAX_TIMES_PASSED = 16
# Others' prompt tokens a step may always carry beside a short chat starting (invariant 11).
STARTING_CHAT_FLOOR = 32


class Scheduler:
    def __init__(self, pool: SlotPool, vocab: Vocab, max_num_batched_tokens: int,
                 max_num_seqs: int | None = None, slot_share: int | None = None,
                 prefill_budget: int | None = None, prompt_cache: PromptCache | None = None,
                 speculative: bool = False, max_long_prompts: int | None = None):
        if max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be at least 1")
        self.pool, self.vocab, self.budget = pool, vocab, max_num_batched_tokens
        # With no stream decoding there is nothing to keep smooth: a step may carry this many
        # prompt tokens instead (llama-server's prefill speed), never fewer than the budget.
        self.prefill_budget = max(prefill_budget or max_num_batched_tokens, max_num_batched_tokens)
        self.max_num_seqs = max_num_seqs or len(pool.slots)
        self.waiting = FairQueue()
        self.stats = SchedulerStats()
        self._admissions = 0
        self.last_step_stopped = False  # for a chat (invariant 12)
        self.starting: Request | None = None  # the chat this step starts: no one else's image
        self.endings = Endings(vocab, self.stats, self.waiting)  # stop rules, ends, n > 1
        self.prefixes = PrefixBook(pool, prompt_cache, self.waiting)
        self.cells = PoolKeeper(pool, self.prefixes, self.waiting, self.stats)
        self.shares = SlotShares(slot_share, self.cells, self.waiting)  # invariant 6
        self.drafts = DraftBook(pool, self.stats, speculative)  # (13)
        self.max_long_prompts = max_long_prompts  # None: no cap (invariant 10)
        self.grammar_shares = GrammarShares()  # grammar CPU time charged per user
        self.costly_grammars = CostlyGrammars()  # grammars lately ended as too costly, per user

    # ---- what the rest reads (interfaces.StepScheduler; scheduler_view.py) -----------
    def view(self, now: float) -> SchedulerView:
        return view_of(self, now)

    def limits(self) -> PoolLimits:
        return limits_of(self)

    def grammar_refusal(self, user: str | None, grammar: str | None) -> str | None:
        return self.costly_grammars.refusal(user, grammar)

    def keep_sequences(self, read_sequence) -> None:  # PrefixBook.keep_slots
        self.prefixes.keep_slots(read_sequence)

    def drop_scope(self, scope: str) -> int:
        """A removed key's prompts, in idle slots and the prompt cache (PrefixBook)."""
        return self.prefixes.drop_scope(scope)

    # ---- between steps -------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.num_prompt_tokens >= self.pool.n_ctx_per_slot:
            raise ValueError(f"a prompt of {request.num_prompt_tokens} tokens does not fit the "
                             f"{self.pool.n_ctx_per_slot} tokens one request may use")
        self.costly_grammars.check(request.user, request.params.grammar)
        first = request.prefix_of
        if first is not None and not first.output_tokens and first.finish_reason is None:
            request.status = RequestStatus.HELD
            self.endings.held.append(request)
        else:
            request.status = RequestStatus.WAITING
            self.waiting.append(request)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT,
              error: str | None = None) -> tuple[Request, TokenEvent] | None:
        """Drop a request wherever it is; its slot is free for the very next schedule()."""
        return self.endings.abort(request_id, self.pool, reason, error)

    def expire_waiting(self, max_wait_s: float, now: float) -> list[tuple[Request, TokenEvent]]:
        """End requests that waited longer than `max_wait_s` without getting a slot."""
        message = f"no slot became free within {max_wait_s:g} s; retry later"
        return [self.abort(r.request_id, FinishReason.TIMEOUT, message)
                for r in self.waiting.overdue(max_wait_s, now)]

    @property
    def running(self) -> list[Slot]:
        return self.cells.running

    def has_work(self) -> bool:
        return bool(self.waiting or self.endings.held or self.pool.tally.busy)

    def pending(self) -> list[Request]:
        """Every request not yet ended: waiting, held, or in a slot."""
        return list(self.waiting) + self.endings.held + [s.request for s in self.running]

    # ---- one step ------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Plan one step. Invariants (pinned by tests/test_scheduler_invariants.py; 13 by
        tests/test_spec_units.py):
        1. Every DECODE slot gets exactly one row in every step, before any prompt chunk, so
           a running stream never waits for someone else's prefill.
        2. A request preempted because the cache pool ran short is the next one admitted,
           ahead of every waiting request of every user.
        3. A cached prefix is reused only when at least MIN_PREFIX_REUSE tokens match (a
           shorter match does not justify taking a recently used slot's cache), and only
           within one cache scope (one API key, unless --shared-prefix-cache); of equal
           slots, one that another waiting request would reuse is left to it.
        4. Only requests that never produced a token expire from the queue (--queue-timeout);
           a preempted request holds a client mid-answer and waits however long it takes.
        5. Prefix-cache queries and hits count first admissions only, never a resume.
        6. With slot shares (API keys), a user holds at most `slot_share` slots while another
           user waits (tests/test_sharing.py).
        7. A step carries at most `budget` tokens while any stream decodes (smoothness), and
           up to `prefill_budget` when none does (nothing to stall: prefill at full speed).
        8. The exceptions to 1: a user over their share of grammar time (grammar_shares.py)
           has their constrained requests sit out steps that serve someone else, and a
           background task (9) sits out the steps in which a chat waits or computes its prompt.
        9. A frontend's background task (Request.background) is admitted only when no chat
           waits or computes its prompt (nor in the step that admits one), its prompt chunks
           come after every other request's; it counts in its key's slot share. A step of
           tasks only carries at most BACKGROUND_STEP_TOKENS tokens, drafts included. A chat
           finding every slot taken, or the cells lent to tasks, takes them back (saved,
           resumed later); when a waiting chat still cannot start, the tasks go on.
        10. At most `max_long_prompts` requests compute a long prompt at once, one key at
           most all but one of them while another's waits (long_prompts.py); a conversation's
           next turn (its prompt cached) is admitted past the long ones waiting.
        11. A waiting request that cannot fit in the pool yet (and was never preempted: 2) is
           passed by the ones behind it that fit, MAX_TIMES_PASSED times at most; and while a
           chat waits that a free slot and the cells can take, its step carries at most half
           as many of others' prompt tokens as its own (STARTING_CHAT_FLOOR at least; half the
           step for a long one, or once a prompt was held so MAX_TIMES_HELD times) and none of
           their images: its first token comes about as soon as alone (nothing is kept for one
           that cannot start).
        12. A step of prompt chunks only, none sampled, with a slot free, may be stopped by a
           chat arriving whose prompt fits a step; one whose first tokens are all of one key
           with more of its requests waiting, by another key's such chat (plan.stop_rule_for);
           never two in a row, nor one with a request stopped MAX_TIMES_STOPPED times.
        13. A step giving a chat its first token carries no drafts (plan.gives_first_token),
           nor more than a cache that cannot be cut back takes out again (pool.rollback).
        """
        plan, self.starting = self.cells.carried_over(self.drafts.pending_trims()), None
        chosen, reserved = self._make_room(plan)
        self._admit_batch(plan)
        lanes = self._lanes()
        budget = self._decode_rows(plan, lanes)
        budget = self._chats(plan, lanes, budget, chosen, reserved)
        budget = self._tasks(plan, lanes, budget, reserved)
        self.drafts.add(plan, min(budget, self.cells.room(plan)))
        self.cells.park_idle(plan)
        plan.encodes, self.prefixes.to_encode = self.prefixes.to_encode, []
        stopped, self.last_step_stopped = self.last_step_stopped, False  # (12)
        plan.stop_rule = plan.stop_rule_for(self.budget if not (stopped or stopped_enough(
            plan.chunks)) and self._slot_free() else 0, self.waiting.users())
        return plan

    def _slot_free(self) -> bool:
        return len(self.running) < min(self.max_num_seqs, len(self.pool.slots))

    def _make_room(self, plan: StepPlan) -> tuple[tuple[Request, Placement] | None, int]:
        """Cells for every decoding row (1), slots back from users over their share (6) and
        from tasks a chat waits for (9), cells back for the next request within its guarantee:
        (that request and its placement, the cells kept back for it from prompt chunks)."""
        self.cells.make_room_for_decode(plan)
        self.shares.enforce(plan)
        self.cells.make_way_for_chat(plan, self.max_num_seqs)
        chosen = self._next_admissible() if self.waiting else None
        owed = chosen[0] if chosen else None
        if owed is not None and owed.background and self._chat_starting(self.running):
            owed = None  # a task waits for the chat (9): no cells are kept back for it
        return chosen, self.cells.reclaim_guarantee(plan, owed)

    def _lanes(self) -> Lanes:
        """Who steps (8, 9): tasks rest while a chat starts, grammar-heavy users sit out."""
        running = self.running
        chat_starting = self._chat_starting(running)
        resting = [s for s in running if s.request.background] if chat_starting else []
        waits = self.grammar_shares.sitting_out(running, bool(self.waiting)) + resting
        stepping = [s for s in running if s not in waits]
        return Lanes(running, chat_starting, resting, stepping,
                     [s for s in stepping if not s.request.background],
                     [s for s in stepping if s.request.background])

    def _decode_rows(self, plan: StepPlan, lanes: Lanes) -> int:
        """One row for each decoding slot that steps (1), within the step's budget (7); a step
        of tasks only is small (9). The budget left."""
        decoding = any(s.state is SlotState.DECODE and s not in lanes.resting for s in lanes.running)
        budget = self.budget if decoding else self.prefill_budget
        if not lanes.chats and not self.waiting.has_foreground():
            budget = min(budget, BACKGROUND_STEP_TOKENS)
        return self._chunks(plan, lanes.stepping, SlotState.DECODE, budget, 0)

    def _chats(self, plan: StepPlan, lanes: Lanes, budget: int, chosen, reserved: int) -> int:
        """Chats' prompt chunks (2), a step the size of a waiting chat that can start now (11),
        then admissions (3). The budget left."""
        kept = 0
        if chosen and not chosen[0].background and self._slot_free() and self.cells.fits_now(
                plan, *chosen):
            own = len(chosen[0].all_tokens) - chosen[1].keep
            others = max(own // 2, held_beside_a_chat(lanes.chats, STARTING_CHAT_FLOOR, budget))
            budget, kept = (own + others, own) if own + others <= budget else (budget, budget // 2)
            self.starting = chosen[0]
        budget = kept + self._chunks(plan, lanes.chats, SlotState.PREFILL, budget - kept, reserved)
        return self._admit_waiting(plan, budget, tasks_too=False)

    def _tasks(self, plan: StepPlan, lanes: Lanes, budget: int, reserved: int) -> int:
        """Background tasks' prompt chunks and admissions, after every chat's (9); if a chat
        waits that cannot start yet, the resting tasks go on rather than nobody."""
        for_tasks = min(budget, BACKGROUND_PREFILL_TOKENS)  # the tasks' share, admissions too
        left = self._chunks(plan, lanes.tasks, SlotState.PREFILL, for_tasks, reserved)
        budget -= for_tasks - (left if lanes.chat_starting else self._admit_waiting(plan, left, True))
        if not plan and lanes.resting:
            budget = self._chunks(plan, lanes.resting, SlotState.DECODE, BACKGROUND_STEP_TOKENS, 0)
            budget = self._chunks(plan, lanes.resting, SlotState.PREFILL, budget, reserved)
        return budget

    def _chat_starting(self, running: list[Slot]) -> bool:
        """A chat waits or computes its prompt: background tasks sit this step out (9)."""
        return self.waiting.has_foreground() or any(
            s.state is SlotState.PREFILL and not s.request.background for s in running)

    def _chunks(self, plan: StepPlan, slots: list[Slot], state: SlotState, budget: int,
                kept_back: int) -> int:
        """A chunk for each of `slots` in `state` while budget and room last; the budget left."""
        room = self.cells.room(plan) - kept_back  # counted down, not asked of the plan again
        for slot in slots:
            if slot.state is state and budget > 0 and room > 0:
                added = self._add_chunk(plan, slot, min(budget, room))
                budget, room = budget - added, room - added
        return budget

    admits_midway = True  # continuous batching: join the running batch at any step

    def _admit_batch(self, plan: StepPlan) -> None:
        """Policies that admit whole batches at once override this (see StaticScheduler)."""

    def _add_chunk(self, plan: StepPlan, slot: Slot, limit: int) -> int:
        pending = slot.pending_tokens()  # an image kept whole, or kept for later (image_rows.py)
        tokens = pending[:chunk_length(pending, limit, self.starting in (None, slot.request))]
        tokens = self.prefixes.checkpoint(plan, slot, tokens)
        if tokens:
            plan.chunks.append(SeqChunk(slot.slot_id, slot.request, tokens, slot.n_cached,
                                        sample=len(tokens) == len(pending)))
        return len(tokens)

    def _admit_waiting(self, plan: StepPlan, budget: int, tasks_too: bool) -> int:
        """Admit while budget and slots last (tasks only `tasks_too`); the budget left."""
        while self.admits_midway and budget > 0 and len(self.running) < self.max_num_seqs:
            admitted = self.waiting and self._admit_next(plan, budget, tasks_too)
            if not admitted:
                return budget
            budget -= admitted
        return budget

    def _admit_next(self, plan: StepPlan, budget: int, tasks_too: bool) -> int:
        """Admit the first waiting request whose user is within their share (a task only
        `tasks_too`) and that fits (11): its first chunk's tokens, or 0."""
        passed: list[Request] = []
        while (chosen := self._next_admissible(passed)) is not None:
            req, where = chosen
            if id(req) in self.cells.preempted or (req.background and not tasks_too):
                return 0
            uncached = len(req.all_tokens) - where.keep
            restored = len(where.restore.tokens) - where.keep if where.restore else 0
            need = max(uncached + 1, restored)  # a restore writes its whole sequence, then cuts
            if self.cells.room_to_admit(plan, where.slot, where.keep, need):
                break
            if req.preemptions or req.times_passed >= MAX_TIMES_PASSED:
                return 0  # preempted (2), or aged: the queue waits for it
            passed.append(req)
        else:
            return 0
        for waiting in passed:
            waiting.times_passed += 1
        req.long_prompt = uncached > self.budget  # (10)
        self._assign(plan, self.waiting.take(req), where)
        return self._add_chunk(plan, where.slot, min(budget, self.cells.room(plan)))

    def _next_admissible(self, passed: list[Request] = ()) -> tuple[Request, Placement] | None:
        """SlotShares' choice among the next few waiting (one per slot) but `passed` (11), with
        its placement: not one waiting for a prompt a running slot computes (reuse.py), nor a
        new long prompt without a place (10)."""
        places = LongPromptPlaces(self.max_long_prompts, self.budget, self.running, self.waiting)
        placed: dict[int, Placement | None] = {}

        def may_start(req: Request) -> bool:
            if any(req is other for other in passed):
                return False
            where = placed[id(req)] = self.prefixes.place(req)
            return where is not None and (bool(req.preemptions) or places.free_for(req.user)
                                          or len(req.all_tokens) - where.keep <= self.budget)
        req = self.shares.next_admissible(may_start, len(self.pool.slots))
        return None if req is None else (req, placed[id(req)])

    def _assign(self, plan: StepPlan, req: Request, where: Placement) -> None:
        slot, keep, source, restore = where.slot, where.keep, where.source, where.restore
        self.prefixes.taken(where)
        if restore is not None or source is not None or slot.n_cached > keep:
            self.prefixes.save(plan, slot)  # what this admission overwrites
        self._admissions += 1
        copied = restore.tokens[:keep] if restore else source.cached[:keep] if source else None
        slot.assign(req, keep, self._admissions, copied, restored=restore is not None)
        req.status = RequestStatus.RUNNING
        if req.admitted_time is None:
            req.admitted_time = time.monotonic()
        plan.admitted.append(Admission(slot.slot_id, req, keep, source.slot_id if source else None,
                                       restore, restore.state if restore else None))
        if req.preemptions == 0:
            self.stats.prefix_cache_queries += req.num_prompt_tokens
            self.stats.prefix_cache_hits += keep

    # ---- after the decode ----------------------------------------------------------
    def update(self, plan: StepPlan, out: StepOutput) -> list[tuple[Request, TokenEvent]]:
        """`out.sampled`: a sampled chunk's tokens (a drafted chunk's: the drafts that held and
        the token after them). Saved states go to the prompt cache, timings to the draft
        pay-off and grammar shares; a request in `out.costly_grammars` ends after its tokens."""
        self.prefixes.keep(out.saved)  # the prompt cache's one owner (reuse.py)
        self.drafts.timed(plan, out.decode_s + out.sample_s)
        self.grammar_shares.charge(plan, out)
        self.stats.count_step(plan)
        events = []
        for chunk in plan.chunks:
            slot = self.pool.slots[chunk.slot_id]
            if slot.request is not chunk.request:
                continue  # aborted while the step ran
            if chunk.start_pos < chunk.request.num_prompt_tokens:
                self.stats.prompt_tokens_computed += min(
                    len(chunk.tokens), chunk.request.num_prompt_tokens - chunk.start_pos)
                events += prompt_progress(chunk)  # only for a request that asked
            if not chunk.sample:
                slot.computed(chunk.tokens)
                continue
            tokens = self.drafts.take(chunk, out.sampled[chunk.slot_id])
            slot.computed(self.drafts.kept_in_cache(chunk, tokens))
            for token in tokens:
                events.append((chunk.request, self.endings.accept(slot, token)))
                if slot.request is not chunk.request:
                    break  # it ended there: tokens drafted past its end never reach the client
            if chunk.slot_id in out.costly_grammars and slot.request is chunk.request:
                self.costly_grammars.ended(chunk.request.user, chunk.request.params.grammar)
                events.append((chunk.request, self.endings.end(slot, FinishReason.GRAMMAR_COST,
                                                        error=too_costly(chunk.request))))
        return events

    def restore_failed(self, plan: StepPlan, entry) -> None:
        """llama.cpp could not take a restored state: the entry is never offered again, and the
        step's admissions (nothing was decoded) go back to the head of the queue."""
        self.prefixes.forget(entry)
        self.cells.unadmit(plan)

    def interrupted(self, plan: StepPlan, saved: list) -> None:
        """The step stopped before its tokens were computed (a chat came during a step of
        tasks or of prompt chunks): its saves are kept, its rows planned again."""
        self.prefixes.keep(saved)
        count_stopped(plan.chunks)
        self.stats.interrupted_steps += 1
        self.last_step_stopped = True  # the next step is never stopped (12)

    def refused(self, plan: StepPlan, refused: dict[int, str],
                saved: list) -> list[tuple[Request, TokenEvent]]:
        """Nothing was decoded: the refused chunks' requests end, the others are planned again."""
        self.prefixes.keep(saved)
        return self.endings.failed(plan, self.pool, refused)

    def cache_full(self) -> bool:
        """No cache room for the batch: evict one sequence for the next plan (False: none left)."""
        return self.cells.preempt_newest()

    def fail(self, plan: StepPlan, message: str) -> list[tuple[Request, TokenEvent]]:
        return self.endings.failed(plan, self.pool, {c.slot_id: message for c in plan.chunks})
