"""Per-key quotas from the TOML config, checked before a request is queued.

    [quotas.default]            # every key without a table of its own
    requests_per_minute = 60
    [quotas.alice]
    tokens_per_day = 200000
    tokens_per_month = 3000000
    max_concurrent = 2

Token quotas count prompt + completion tokens of finished requests, from the ledger (a running
request can take a key past its limit; the next one is refused). Over a quota: 429 with
Retry-After and the limit and reset time in the error; other keys are unaffected.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields
from datetime import datetime, timedelta

from localserve.config import SettingsError


@dataclass(frozen=True)
class Quota:
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None
    requests_per_minute: float | None = None
    max_concurrent: int | None = None


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


def _until(moment: datetime) -> float:
    return max(1.0, (moment - datetime.now()).total_seconds())


class QuotaKeeper:
    def __init__(self, quotas: dict[str, Quota], clock=time.monotonic):
        self.quotas, self.clock = quotas, clock
        self._minute: dict[str, list[float]] = {}

    def quota(self, key: str) -> Quota | None:
        return self.quotas.get(key) or self.quotas.get("default")

    def check(self, key: str, tokens_today: int, tokens_month: int, in_flight: int) -> None:
        """Raise QuotaError for the first limit `key` is over; else count this request."""
        q = self.quota(key)
        if q is None:
            return
        now = datetime.now()
        if q.tokens_per_day is not None and tokens_today >= q.tokens_per_day:
            midnight = datetime.combine(now.date() + timedelta(days=1), datetime.min.time())
            raise QuotaError("tokens_per_day", f"key '{key}' used {tokens_today} of its "
                             f"{q.tokens_per_day} tokens today; the quota resets at midnight "
                             f"(server time)", _until(midnight))
        if q.tokens_per_month is not None and tokens_month >= q.tokens_per_month:
            first = (now.replace(day=1) + timedelta(days=32)).replace(day=1, hour=0, minute=0,
                                                                     second=0, microsecond=0)
            raise QuotaError("tokens_per_month", f"key '{key}' used {tokens_month} of its "
                             f"{q.tokens_per_month} tokens this month; the quota resets on "
                             f"{first:%Y-%m-%d}", _until(first))
        if q.max_concurrent is not None and in_flight >= q.max_concurrent:
            raise QuotaError("max_concurrent", f"key '{key}' already has {in_flight} requests "
                             f"running or waiting (max_concurrent {q.max_concurrent}); send the "
                             f"next when one finishes", 1.0)
        if q.requests_per_minute is not None:
            stamps = [t for t in self._minute.get(key, []) if self.clock() - t < 60.0]
            if len(stamps) >= q.requests_per_minute:
                raise QuotaError("requests_per_minute", f"key '{key}' sent {len(stamps)} "
                                 f"requests in the last minute (requests_per_minute "
                                 f"{q.requests_per_minute:g})", math.ceil(60.0 - (self.clock() - stamps[0])))
            stamps.append(self.clock())
            self._minute[key] = stamps
