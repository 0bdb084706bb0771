"""PoolKeeper: the cells of the one cache pool (slots.py), the scheduler's third bookkeeper
beside PrefixBook and DraftBook (nano-vllm's BlockManager role: the scheduler asks whether
there is room, and who gives it up).

Every slot is guaranteed `pool.guarantee` cells; a request may borrow past that what no other
slot uses. Room comes, in this order, from: free cells; idle slots' kept prefixes (least
recently used first, saved to the prompt cache first); then preemption. A sequence preempted
is saved to the prompt cache before its cells are cleared, so it resumes by restoring:
  - "pool": a decoding slot found no cell: the biggest borrower goes (else the newest
    sequence), first in the queue to come back;
  - "guarantee": a waiting request within its guarantee finds the pool lent out: borrowers
    give their cells back, the one borrowing most first, and wait behind it;
  - "share": a user over their slot share gives a slot back to a waiting colleague
    (slot_shares.py);
  - "task": a chat waits and every slot is taken, or the chat does not fit the free cells
    while a background task borrows: the newest task (the one borrowing most) gives its slot
    back, and waits at the head of the tasks' lane. A task never keeps a chat waiting for
    cells it borrowed.
"""

from __future__ import annotations

import time

from localserve.engine.plan import SlotSave, StepPlan
from localserve.engine.request import Request, RequestStatus
from localserve.engine.reuse import PrefixBook
from localserve.engine.scheduler_stats import PreemptionWatch, SchedulerStats, log_preemption
from localserve.engine.slots import Slot, SlotPool, SlotState
from localserve.engine.waiting import FairQueue


class PoolKeeper:
    def __init__(self, pool: SlotPool, prefixes: PrefixBook, waiting: FairQueue,
                 stats: SchedulerStats):
        self.pool, self.prefixes, self.waiting, self.stats = pool, prefixes, waiting, stats
        self.preemption_watch = PreemptionWatch()
        self._pending_drops: list[int] = []  # preempt_newest's, for the next plan
        self._pending_saves: list[SlotSave] = []
        self.preempted: set[int] = set()  # this step's (by id): not admitted again before its
        # save is in the prompt cache, in the next step, where it is restored from

    def carried_over(self, trims: list[tuple[int, int]]) -> StepPlan:
        """A new plan, carrying last step's failed drafts' trims and preempt_newest's work."""
        plan = StepPlan(dropped=self._pending_drops, trims=trims, saves=self._pending_saves)
        self._pending_drops, self._pending_saves = [], []
        self.preempted = set()
        return plan

    def room(self, plan: StepPlan) -> int:
        """Cells of the pool still free for this step's batch."""
        return self.pool.free - plan.num_tokens

    @property
    def running(self) -> list[Slot]:
        return self.pool.running

    def room_to_admit(self, plan: StepPlan, slot: Slot, keep: int, need: int) -> bool:
        """Admit only if the whole remaining prompt fits: drop other idle slots' kept
        prefixes (least recently used first) if that makes room; never preempt to admit
        (reclaim_guarantee did, before this step's chunks, when the request is owed it).
        `keep`: the prefix the slot holds once admitted, its own or copied or restored in;
        `need`: the cells it takes beyond that."""
        freed_by_slot = slot.n_cached - keep  # the chosen slot's cache beyond the shared prefix
        while self.room(plan) + freed_by_slot < need:
            victim = self.pool.lru_idle_with_cache(exclude=slot)
            if victim is None:
                return False
            self.drop(plan, victim)
        return True

    def fits_now(self, plan: StepPlan, req: Request, where) -> bool:
        """Whether `req`, placed at `where` (reuse.Placement), fits this step's free cells and
        idle slots' kept prefixes (room_to_admit drops those for it)."""
        idle = sum(s.n_cached for s in self.pool.slots if not s.busy)
        return len(req.all_tokens) - where.keep < self.room(plan) + idle

    def reclaim_guarantee(self, plan: StepPlan, req: Request | None) -> int:
        """The next request to admit fits a slot's guarantee but not the free cells: take them
        back from borrowers, the one borrowing most first. Returns the cells kept back for it
        from this step's prompt chunks (it is admitted after them)."""
        if req is None or all(s.busy for s in self.pool.slots):
            return 0
        need = len(req.all_tokens) + 1
        if need > self.pool.guarantee:
            return 0
        decode_rows = sum(1 for s in self.running if s.state is SlotState.DECODE)
        while self.pool.free < need + decode_rows:
            idle = self.pool.lru_idle_with_cache()
            if idle is not None:
                self.drop(plan, idle)
                continue
            borrower = max(self.running, key=self.pool.borrowed, default=None)
            if borrower is None or not self.pool.borrowed(borrower):
                return 0
            self.preempt_slot(plan, borrower, "guarantee", req)
        return need

    def make_way_for_chat(self, plan: StepPlan, max_running: int) -> None:
        """A chat waits and the slots are all taken, some by background tasks: the newest
        task steps aside (else the chat would wait for it, or, tasks resting while a chat
        waits, everyone would). A chat that does not fit the free cells takes back what
        tasks borrow, the one borrowing most first."""
        running = self.running
        tasks = [s for s in running if s.request.background]
        chat = self.waiting.first_foreground() if tasks else None
        if chat is None:
            return
        if len(running) >= max_running:
            self.preempt_slot(plan, max(tasks, key=lambda s: s.admitted_seq), "task")
        while self.pool.free <= len(chat.all_tokens):
            borrower = max(tasks, key=self.pool.borrowed)
            if not self.pool.borrowed(borrower):  # a slot given back borrows nothing
                return
            self.preempt_slot(plan, borrower, "task")

    def make_room_for_decode(self, plan: StepPlan) -> None:
        """Every decoding slot needs one free cell this step; find them or preempt."""
        while True:
            need = sum(1 for s in self.pool.running if s.state is SlotState.DECODE)
            if self.pool.free >= need:
                return
            victim = self.pool.lru_idle_with_cache()
            if victim is not None:
                self.drop(plan, victim)
            elif not self._preempt(plan):
                return

    def park_idle(self, plan: StepPlan) -> None:
        """A step that computes something sends idle slots' sequences to the prompt cache:
        every row attends over every cell of the pool (llama.cpp's unified cache masks other
        sequences' cells, at a cost: six idle 1,000-token sequences made a lone decode row
        1.5x as slow), so a conversation kept in the pool slows everyone until it returns,
        and restoring it then is one copy (milliseconds). A step of background tasks only
        parks nothing: its rows alone pay for the idle cells, while the chat a title is for
        comes back next (a save and a restore took 0.1 s of its 0.18 s first token).
        Nothing is parked from a stream of its own (SlotPool.streams)."""
        if self.pool.streams:
            return  # a stream per slot: an idle one costs nobody anything
        if plan and not plan.background_only and self.prefixes.prompt_cache is not None:
            for slot in self.pool.slots:
                if not slot.busy and slot.cached:
                    self.drop(plan, slot)

    def drop(self, plan: StepPlan, slot: Slot) -> None:
        """Clear a slot's sequence for room, saved to the prompt cache first (restored, not
        recomputed, when its conversation comes back)."""
        self.prefixes.save(plan, slot)
        slot.forget()
        plan.dropped.append(slot.slot_id)

    def _preempt(self, plan: StepPlan) -> bool:
        """The pool is short: evict the biggest borrower, else the newest sequence; it is the
        next one admitted."""
        running = self.running
        if len(running) < 2:
            return False  # a lone sequence that fills the pool ends by its length limit instead
        self.preempt_slot(plan, max(running, key=lambda s: (self.pool.borrowed(s), s.admitted_seq)),
                          "pool")
        self.preemption_watch.record(time.monotonic())
        return True

    def preempt_slot(self, plan: StepPlan, slot: Slot, why: str,
                     made_room_for: Request | None = None) -> None:
        """Save a running sequence, clear it and put its request back in the queue: at the
        very head for "pool"; for "share" and "guarantee" at the head of its own user's turn
        but behind the request it made room for (see the module doc)."""
        req = slot.request
        log_preemption(slot, why, self.pool.ctx_size, len(self.running), len(self.waiting))
        self.drop(plan, slot)
        slot.release()
        req.status = RequestStatus.WAITING
        req.preemptions += 1
        self.preempted.add(id(req))
        if why == "pool":
            self.waiting.push_front(req)
            self.stats.preemptions += 1
        else:
            self.waiting.requeue(req, behind=made_room_for)
            self.stats.share_preemptions += why == "share"
            self.stats.borrow_preemptions += why == "guarantee"
            self.stats.task_preemptions += why == "task"

    def unadmit(self, plan: StepPlan) -> None:
        """Take back the admissions of a step that did not run: their sequences are cleared
        with the next plan, their requests the next ones placed (cached counts set anew)."""
        for admission in reversed(plan.admitted):
            slot, req = self.pool.slots[admission.slot_id], admission.request
            if slot.request is not req:
                continue
            slot.forget()
            slot.release()
            self._pending_drops.append(slot.slot_id)
            req.status = RequestStatus.WAITING
            if not req.output_tokens:
                req.detokenizer = None
            self.waiting.push_front(req)

    def preempt_newest(self) -> bool:
        """The runner found no room for a planned batch (fragmentation): evict one sequence;
        it is saved and cleared with the next plan, and the batch is planned again."""
        plan = StepPlan()
        done = self._preempt(plan)
        self._pending_drops.extend(plan.dropped)
        self._pending_saves.extend(plan.saves)
        return done
