"""Per-key request rate: a token bucket each, refilled at --rate-limit per second up to
--rate-burst. A key over its rate gets 429 with the seconds until its next request is allowed;
a request that may wait its turn (embeddings: a frontend sends one per document chunk, all at
once) takes a place in line instead, up to `max_wait` seconds ahead.

Refusals are paced too: each costs the server a parse, and a client looping on a hundred
connections got ~900 of them a second, which took the CPU everyone's streams need. A key's
refusals are answered one per REFUSAL_PACE_S (held up to MAX_REFUSAL_HOLD_S, for free on the
event loop), so a flood gets about that rate of answers whatever its number of connections,
while one request over the rate is answered within REFUSAL_PACE_S."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

MAX_BUCKETS = 10_000  # names kept; the least recently seen go first (a full bucket anyway)
REFUSAL_PACE_S = 0.05  # a key's refusals are answered no faster than this apart (20 a second)
MAX_REFUSAL_HOLD_S = 10.0  # the longest a refusal is held; past that, answered at this delay


class RateLimiter:
    def __init__(self, rate: float, burst: int, clock=time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # name -> (tokens, at)
        self._refusals: OrderedDict[str, float] = OrderedDict()  # name -> when its last is answered
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def try_acquire(self, key: str, max_wait: float = 0.0, scale: int = 1) -> tuple[bool, float]:
        """Take one request from `key`'s bucket: (True, 0.0) now; (True, s) taken, to be sent
        after s seconds (at most max_wait: the bucket goes into debt, so that those who wait
        keep their order); (False, s) refused, s seconds until the next would be allowed.
        `scale`: this bucket's rate and burst are that many keys' (a frontend as a whole)."""
        if not self.enabled:
            return True, 0.0
        now, rate, burst = self.clock(), self.rate * scale, float(self.burst * scale)
        with self._lock:
            tokens, updated = self._buckets.pop(key, (burst, now))
            tokens = min(burst, tokens + (now - updated) * rate)
            wait = max(0.0, (1.0 - tokens) / rate)
            taken = wait <= max_wait
            _keep(self._buckets, key, (tokens - 1.0 if taken else tokens, now))
            return taken, wait

    def refusal_delay(self, key: str, scale: int = 1) -> float:
        """Seconds to hold `key`'s refusal before answering it: one REFUSAL_PACE_S (divided
        by `scale`) after the key's previous refusal, at most MAX_REFUSAL_HOLD_S from now."""
        now, pace = self.clock(), REFUSAL_PACE_S / scale
        with self._lock:
            at = max(now, self._refusals.pop(key, now)) + pace
            if at - now > MAX_REFUSAL_HOLD_S:  # held as long as may be: the line stays put
                at = now + MAX_REFUSAL_HOLD_S
            _keep(self._refusals, key, at)
            return at - now


def _keep(table: OrderedDict, key: str, value) -> None:
    """`table[key] = value` as the most recent name, the least recent ones dropped past
    MAX_BUCKETS (callers pop `key` first, so that it moves to the end)."""
    table[key] = value
    while len(table) > MAX_BUCKETS:
        table.popitem(last=False)
