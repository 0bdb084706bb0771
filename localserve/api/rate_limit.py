"""Per-key request rate: a token bucket each, refilled at --rate-limit per second up to
--rate-burst. A key over its rate gets 429 with the seconds until its next request is allowed."""

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

    def try_acquire(self, key: str) -> float:
        """Take one request from `key`'s bucket: 0.0 if allowed, else seconds to wait."""
        if not self.enabled:
            return 0.0
        now = self.clock()
        with self._lock:
            tokens, updated = self._buckets.get(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - updated) * self.rate)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate
