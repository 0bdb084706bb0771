"""Per-key request rate: a token bucket each, refilled at --rate-limit per second up to
--rate-burst. A key over its rate gets 429 with the seconds until its next request is allowed;
a request that may wait its turn (embeddings: a frontend sends one per document chunk, all at
once) takes a place in line instead, up to `max_wait` seconds ahead."""

from __future__ import annotations

import threading
import time


class RateLimiter:
    def __init__(self, rate: float, burst: int, clock=time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key name -> (tokens, updated at)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def try_acquire(self, key: str, max_wait: float = 0.0) -> tuple[bool, float]:
        """Take one request from `key`'s bucket: (True, 0.0) now; (True, s) taken, to be sent
        after s seconds (at most max_wait: the bucket goes into debt, so that those who wait
        keep their order); (False, s) refused, s seconds until the next would be allowed."""
        if not self.enabled:
            return True, 0.0
        now = self.clock()
        with self._lock:
            tokens, updated = self._buckets.get(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - updated) * self.rate)
            wait = max(0.0, (1.0 - tokens) / self.rate)
            taken = wait <= max_wait
            self._buckets[key] = (tokens - 1.0 if taken else tokens, now)
            return taken, wait
