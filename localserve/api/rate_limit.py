"""Per-key request rate: a token bucket each, refilled at --rate-limit per second up to
--rate-burst. A key over its rate gets 429 with the seconds until its next request is allowed;
a request that may wait its turn (embeddings: a frontend sends one per document chunk, all at
once) takes a place in line instead, up to `max_wait` seconds ahead."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

MAX_BUCKETS = 10_000  # names kept; the least recently seen go first (a full bucket anyway)


class RateLimiter:
    def __init__(self, rate: float, burst: int, clock=time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # name -> (tokens, at)
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
            self._buckets[key] = (tokens - 1.0 if taken else tokens, now)
            while len(self._buckets) > MAX_BUCKETS:
                self._buckets.popitem(last=False)
            return taken, wait
