"""Per-key quotas from the TOML config, checked before a request is queued.

    [quotas.default]            # every key without a table of its own
    requests_per_minute = 60
    [quotas.alice]
    tokens_per_day = 200000
    tokens_per_month = 3000000
    max_concurrent = 2

Token quotas count prompt + completion tokens of finished requests, from the ledger, plus what
running requests may still use (reserved at submission: prompt + max_tokens x n, released when
the response ends), so a burst overshoots by at most one request's reservation. Over a quota:
429 with Retry-After and the limit and reset time in the error; other keys are unaffected.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, fields
from datetime import datetime, timedelta

from localserve.common.config import SettingsError


@dataclass(frozen=True)
class Quota:
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None
    requests_per_minute: float | None = None
    max_concurrent: int | None = None

    def __str__(self) -> str:
        """As the TOML table says it: 'tokens_per_day = 50, max_concurrent = 2'."""
        return ", ".join(f"{name} = {getattr(self, name)}" for name in LIMITS
                         if getattr(self, name) is not None) or "no limit"


LIMITS = [f.name for f in fields(Quota)]


def parse_quotas(tables: dict, source: str) -> dict[str, Quota]:
    """[quotas.NAME] tables -> {name: Quota}; an unknown or non-positive limit is refused."""
    quotas = {}
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise SettingsError(f"{source}: [quotas.{name}] must be a table of limits")
        for limit, value in table.items():
            if limit not in LIMITS:
                raise SettingsError(f"{source}: [quotas.{name}] {limit}: unknown limit "
                                    f"(known: {', '.join(LIMITS)})")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise SettingsError(f"{source}: [quotas.{name}] {limit} = {value!r}: expected a "
                                    f"positive number")
        quotas[name] = Quota(**table)
    return quotas


class QuotaError(Exception):
    def __init__(self, limit: str, message: str, retry_after_s: float):
        super().__init__(message)
        self.limit, self.retry_after_s = limit, retry_after_s


def next_month(now: datetime) -> datetime:
    """Midnight starting the month after `now`'s: when a monthly quota resets."""
    return datetime(now.year + now.month // 12, now.month % 12 + 1, 1)


def _until(moment: datetime) -> float:
    return max(1.0, (moment - datetime.now()).total_seconds())


class Reservation:
    """One request's hold on its key's quotas, from its admission to its last byte: it counts
    against max_concurrent, and the tokens it may use (prompt + max_tokens x n) count against
    the token quotas until the ledger has its real usage. Released once (api/limits.py
    ReleaseReservations, after the response ends, whatever way it ends)."""

    def __init__(self, keeper: "QuotaKeeper", key: str, stamp: float | None = None):
        self.keeper, self.key, self.tokens, self.released = keeper, key, 0, False
        self.stamp = stamp  # its place in requests_per_minute

    def reserve_tokens(self, n: int, tokens_today: int, tokens_month: int) -> None:
        self.keeper._reserve_tokens(self, n, tokens_today, tokens_month)

    def release(self, refused: bool = False) -> None:
        """refused: the request was turned away before any work (a 4xx of its body), so it
        does not count against requests_per_minute either."""
        self.keeper._release(self, refused)


class QuotaKeeper:
    """Checks and reservations are made under one lock, so a burst sent at once is counted
    request by request: it overshoots a token quota by at most one request's reservation and
    never exceeds max_concurrent."""

    WINDOW_S = 60.0  # requests_per_minute counts the stamps this recent
    MAX_NAMES = 1024  # names in the minute window before the quiet ones are dropped

    def __init__(self, quotas: dict[str, Quota], clock=time.monotonic):
        self.quotas, self.clock = quotas, clock
        self._minute: dict[str, list[float]] = {}
        self._active: Counter = Counter()  # key -> reservations held
        self._reserved: Counter = Counter()  # key -> tokens reserved by running requests
        self._lock = threading.Lock()

    def quota(self, key: str) -> Quota | None:
        return self.quotas.get(key) or self.quotas.get("default")

    def reserve(self, key: str, tokens_today: int, tokens_month: int) -> Reservation | None:
        """Raise QuotaError for the first limit `key` is over; else hold a place for this
        request (None: the key has no quota)."""
        q = self.quota(key)
        if q is None:
            return None
        with self._lock:
            self._check_tokens(key, q, tokens_today, tokens_month)
            if q.max_concurrent is not None and self._active[key] >= q.max_concurrent:
                raise QuotaError("max_concurrent", f"key '{key}' already has {self._active[key]} "
                                 f"requests running or waiting (max_concurrent "
                                 f"{q.max_concurrent}); send the next when one finishes", 1.0)
            stamp = self._count_minute(key, q)
            self._active[key] += 1
            return Reservation(self, key, stamp)

    def _reserve_tokens(self, held: Reservation, n: int, tokens_today: int,
                        tokens_month: int) -> None:
        q = self.quota(held.key)
        with self._lock:
            if q is not None:
                self._check_tokens(held.key, q, tokens_today, tokens_month)
            self._reserved[held.key] += n
            held.tokens += n

    def _release(self, held: Reservation, refused: bool = False) -> None:
        with self._lock:
            if held.released:
                return
            held.released = True
            self._active[held.key] -= 1
            self._reserved[held.key] -= held.tokens
            for counts in (self._active, self._reserved):  # a name done with leaves no entry
                if counts[held.key] == 0:
                    del counts[held.key]
            stamps = self._minute.get(held.key, [])
            if refused and held.stamp in stamps:
                stamps.remove(held.stamp)

    def _check_tokens(self, key: str, q: Quota, tokens_today: int, tokens_month: int) -> None:
        now = datetime.now()
        today, month = tokens_today + self._reserved[key], tokens_month + self._reserved[key]
        if q.tokens_per_day is not None and today >= q.tokens_per_day:
            midnight = datetime.combine(now.date() + timedelta(days=1), datetime.min.time())
            raise QuotaError("tokens_per_day", f"key '{key}' used {tokens_today} of its "
                             f"{q.tokens_per_day} tokens today ({self._reserved[key]} more are "
                             f"held by its running requests); the quota resets at midnight "
                             f"(server time)", _until(midnight))
        if q.tokens_per_month is not None and month >= q.tokens_per_month:
            first = next_month(now)
            raise QuotaError("tokens_per_month", f"key '{key}' used {tokens_month} of its "
                             f"{q.tokens_per_month} tokens this month ({self._reserved[key]} more "
                             f"are held by its running requests); the quota resets on "
                             f"{first:%Y-%m-%d}", _until(first))

    def _count_minute(self, key: str, q: Quota) -> float | None:
        if q.requests_per_minute is None:
            return None
        stamps = [t for t in self._minute.get(key, []) if self.clock() - t < self.WINDOW_S]
        if len(stamps) >= q.requests_per_minute:
            raise QuotaError("requests_per_minute", f"key '{key}' sent {len(stamps)} "
                             f"requests in the last minute (requests_per_minute "
                             f"{q.requests_per_minute:g})",
                             math.ceil(self.WINDOW_S - (self.clock() - stamps[0])))
        stamp = self.clock()
        stamps.append(stamp)
        if key not in self._minute and len(self._minute) >= self.MAX_NAMES:
            self._forget_quiet_names(stamp)
        self._minute[key] = stamps
        return stamp

    def _forget_quiet_names(self, now: float) -> None:
        """Names (a frontend's colleagues: any number) with no request in the last minute
        hold nothing the minute window still counts: dropped, so the table stays bounded."""
        for name in [k for k, v in self._minute.items() if not v or now - v[-1] >= self.WINDOW_S]:
            del self._minute[name]
