"""Slot shares between identities (API keys), the scheduler's invariant 6: while another user
waits, one user holds at most `share` slots' worth of cells. Admission skips a user at their
share; one above it gives their newest slot back (a background task before a chat). A
frontend's background task counts in its key's share like any request: dressed as one, two
long requests kept a colleague's document waiting 366 steps."""

from __future__ import annotations

from collections import Counter

from localserve.engine.plan import StepPlan
from localserve.engine.pool_keeper import PoolKeeper
from localserve.engine.request import Request
from localserve.engine.waiting import FairQueue


class SlotShares:
    def __init__(self, share: int | None, cells: PoolKeeper, waiting: FairQueue):
        self.share = share  # None: no cap
        self.cells, self.waiting = cells, waiting

    def held(self) -> Counter:
        """What each user holds in slots' worth of cells (borrowing 3 guarantees weighs 3 slots)."""
        held: Counter = Counter()
        for slot in self.cells.running:
            held[slot.request.user] += max(1, -(-slot.n_cached // self.cells.pool.guarantee))
        return held

    def next_admissible(self, may_start=None, look_ahead: int = 0) -> Request | None:
        """The queue's head, unless its user is at their share while others wait: then the
        first request of a user below it. With `may_start`, the first such request it allows
        among the first `look_ahead` waiting (scheduler.py: long prompts at their cap)."""
        if self.share is None and may_start is None:
            return self.waiting.peek()
        held = self.held() if self.share is not None else None
        waiting_users = self.waiting.users()
        for seen, req in enumerate(self.waiting.in_turn(held)):
            if may_start is not None and seen >= look_ahead:
                return None
            if held is not None and held[req.user] >= self.share and waiting_users - {req.user}:
                continue
            if may_start is None or may_start(req):
                return req
        return None

    def enforce(self, plan: StepPlan) -> None:
        """A user above their share while someone else waits gives back their newest slot, but
        never their largest request: one request may use the whole pool (a colleague's long
        document over the share by itself was saved and restored at every other arrival)."""
        if self.share is None or not self.waiting:
            return
        waiting_users = self.waiting.users()
        for user, n in self.held().items():
            if n > self.share and waiting_users - {user}:
                mine = [s for s in self.cells.running if s.request.user == user]
                largest = max(mine, key=lambda s: s.n_cached)
                others = [s for s in mine if s is not largest]
                if others:
                    newest = max(others, key=lambda s: (s.request.background, s.admitted_seq))
                    self.cells.preempt_slot(plan, newest, "share")
