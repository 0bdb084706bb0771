"""The scheduler's invariant 10: few new long prompts computed at once (every row attends over
the whole pool, so few at once prefill faster), fairly between keys.

A long prompt is one with more uncached tokens than one step's budget (a new document). At
most `cap` are computed at once, and one key holds at most all but one of those places while
another key's long prompt waits (one key's four documents kept every colleague's waiting for
their answers). A place is counted while its prompt is computed: it is free again once the
answer starts. A conversation's next turn (cached) and a preempted request never need one."""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from localserve.engine.request import Request
from localserve.engine.slots import Slot, SlotState


class LongPromptPlaces:
    def __init__(self, cap: int | None, budget: int, running: Iterable[Slot],
                 waiting: Iterable[Request]):
        self.cap = cap
        self.held = Counter(s.request.user for s in running
                            if s.request.long_prompt and s.state is SlotState.PREFILL)
        self.waiting_long = {r.user for r in waiting if len(r.all_tokens) > budget}

    def free_for(self, user: str | None) -> bool:
        """May `user` start computing one more long prompt now?"""
        if self.cap is None:
            return True
        if sum(self.held.values()) >= self.cap:
            return False
        return self.held[user] < self.cap - 1 or not self.waiting_long - {user}
