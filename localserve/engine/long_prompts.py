"""The scheduler's invariant 10: few new long prompts computed at once (every row attends over
the whole pool, so few at once prefill faster), fairly between keys.

A long prompt is one with more uncached tokens than one step's budget (a new document). At
most `cap` are computed at once, and one key holds at most all but one of those places while
another key's long prompt waits (one key's four documents kept every colleague's waiting for
their answers). A place is counted while its prompt is computed: it is free again once the
answer starts. A conversation's next turn (cached) and a preempted request never need one.

And the floor of progress a prompt keeps beside chats (invariants 11 and 12), so that chats
arriving back to back, from however many connections and keys, cannot stall a colleague's
document (hardening round 7: 4.2x her time alone): a prompt held to STARTING_CHAT_FLOOR tokens
beside a starting chat MAX_TIMES_HELD times gets half of every such step from then on, and a
request whose steps were stopped MAX_TIMES_STOPPED times is never in a stopped step again."""

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


MAX_TIMES_HELD = 4
MAX_TIMES_STOPPED = 2


def held_beside_a_chat(slots: Iterable[Slot], floor: int, budget: int) -> int:
    """A chat starts this step: the others' prompts among `slots` are held to a few tokens
    (`floor`), counted; half the step (`budget`) once one was held MAX_TIMES_HELD times."""
    prompts = [s.request for s in slots if s.state is SlotState.PREFILL]
    for request in prompts:
        request.times_held += 1
    return budget // 2 if any(r.times_held > MAX_TIMES_HELD for r in prompts) else floor


def count_stopped(chunks) -> None:
    """A chat stopped this step midway: each of its requests was stopped once more."""
    for chunk in chunks:
        chunk.request.times_stopped += 1


def stopped_enough(chunks) -> bool:
    """Does this step carry a request whose steps were already stopped MAX_TIMES_STOPPED
    times? Then no chat stops it (its work would be thrown away once more)."""
    return any(c.request.times_stopped >= MAX_TIMES_STOPPED for c in chunks)
