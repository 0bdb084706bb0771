"""Grammar work charged to the key that asked for it.

A constrained token costs CPU on the engine loop (runner/sampling.py), and every other stream
waits for it: a grammar just under the per-token bound, run to max_tokens by three requests of
one key, slowed a colleague's stream to 0.15x. Slot shares do not see that cost, so it is
counted here, per user, as llama.cpp's own work is: in seconds of the loop thread's CPU.

  - GrammarShares: each step, a user's grammar seconds are charged to them, and every user in
    debt is paid back GRAMMAR_SHARE of that step's decode time. While a user's debt is above
    GRAMMAR_BURST_S, their constrained requests sit the steps out (they wait, they are not
    ended): over time a key's grammars take at most about GRAMMAR_SHARE of the time the
    model itself takes, whatever the per-token cost of each.
  - CostlyGrammars: a grammar that was ended as too costly (FinishReason.GRAMMAR_COST) is
    refused at once when the same user sends it again within COSTLY_GRAMMAR_MEMORY_S, before it
    costs anyone a step.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict

from localserve.engine.plan import StepOutput, StepPlan
from localserve.engine.request import Request

GRAMMAR_SHARE = 0.5  # a user's grammar CPU time, at most this share of the decode time
GRAMMAR_BURST_S = 0.05  # debt a user may run up before their grammars wait
GRAMMAR_DEBT_CAP_S = 2.0  # most a user owes: what they ran up alone is not held against them for long
COSTLY_GRAMMAR_MEMORY_S = 600.0
COSTLY_GRAMMARS_KEPT = 1024  # (user, grammar) pairs remembered, least recent dropped first


class GrammarRefused(ValueError):
    """A grammar this user's earlier request ended as too costly, sent again too soon."""


class GrammarShares:
    def __init__(self, share: float = GRAMMAR_SHARE):
        self.share = share
        self.debt: dict[str | None, float] = {}  # user -> grammar CPU seconds owed
        self.charged: dict[str | None, float] = {}  # user -> grammar CPU seconds in all (what
        # the key was charged: the tests read it; nothing serves it yet)

    def charge(self, plan: StepPlan, out: StepOutput) -> None:
        """Charge each user this step's grammar seconds; pay every debt back its allowance."""
        spent: dict[str | None, float] = {}
        for chunk in plan.chunks:
            seconds = out.grammar_s.get(chunk.slot_id, 0.0)
            if seconds:
                user = chunk.request.user
                spent[user] = spent.get(user, 0.0) + seconds
                self.charged[user] = self.charged.get(user, 0.0) + seconds
        allowance = self.share * out.decode_s
        for user in {*self.debt, *spent}:
            owed = self.debt.get(user, 0.0) + spent.get(user, 0.0) - allowance
            if owed > 0:
                self.debt[user] = min(owed, GRAMMAR_DEBT_CAP_S)
            else:
                self.debt.pop(user, None)

    def waits(self, user: str | None) -> bool:
        """Whether this user's constrained requests sit this step out."""
        return self.debt.get(user, 0.0) > GRAMMAR_BURST_S

    def sitting_out(self, running: list, others_waiting: bool) -> list:
        """Constrained slots of users over their grammar share, when someone else's request
        can use the step (else they run: nobody waits for them, and steps repay the debt)."""
        waits = [s for s in running if s.request.params.grammar is not None
                 and self.waits(s.request.user)]
        return waits if others_waiting or len(waits) < len(running) else []


class CostlyGrammars:
    def __init__(self, memory_s: float = COSTLY_GRAMMAR_MEMORY_S):
        self.memory_s = memory_s
        self._ended: OrderedDict[tuple[str | None, str], float] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _key(user: str | None, grammar: str) -> tuple[str | None, str]:
        return user, hashlib.sha256(grammar.encode()).hexdigest()

    def ended(self, user: str | None, grammar: str | None, now: float | None = None) -> None:
        if grammar is None:
            return
        key = self._key(user, grammar)
        with self._lock:
            self._ended.pop(key, None)
            self._ended[key] = time.monotonic() if now is None else now
            while len(self._ended) > COSTLY_GRAMMARS_KEPT:
                self._ended.popitem(last=False)

    def check(self, user: str | None, grammar: str | None, now: float | None = None) -> None:
        """Raise GrammarRefused if this user's same grammar was ended as too costly lately."""
        why = self.refusal(user, grammar, now)
        if why:
            raise GrammarRefused(why)

    def refusal(self, user: str | None, grammar: str | None, now: float | None = None) -> str | None:
        """Why this user's grammar is refused (ended as too costly lately), else None. Asked
        from the HTTP side too (before a request is queued): hence the lock."""
        if grammar is None:
            return None
        key = self._key(user, grammar)
        now = time.monotonic() if now is None else now
        with self._lock:
            at = self._ended.get(key)
            if at is None:
                return None
            if now - at >= self.memory_s:
                del self._ended[key]
                return None
        return (f"this grammar was ended as too costly to constrain {now - at:.0f} s ago (a "
                f"colleague's answers wait while it runs); it is refused for "
                f"{self.memory_s - (now - at):.0f} s more: simplify its alternatives")


def too_costly(request: Request) -> str:
    """Why a request whose grammar grew too costly to constrain was ended."""
    return (f"the grammar became too costly to constrain a token after "
            f"{request.num_output_tokens} tokens (a colleague's answers wait while it runs); "
            f"simplify its alternatives")
