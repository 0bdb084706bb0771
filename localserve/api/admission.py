"""Admission: what every route that runs a model goes through before its work is queued,
one dependency (`admit`, on every such router in app.py) that hands the route an `Admitted`:

    require_key (auth.py)  who is asking: 401 without a valid key
    limit_rate             the key's request rate: 429
    hold_quota             the key's quotas: 429; holds a place until the response ends
                           (released by limits.ReleaseReservations however it ends)
  then, from the Admitted:
    .lease(model)          the model the body names, loaded and ready: 404 unknown, 503 loading
    .reserve_tokens(n)     what the submitted request may use, held against token quotas
                           (serving.submit, once the prompt is known)
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from fastapi import Request

from localserve.api.auth import Caller, caller, require_key
from localserve.api.schemas import OpenAIError, SamplingBody
from localserve.office.quotas import QuotaError, Reservation
from localserve.office.ledger import Ledger
from localserve.office.office import Office
from localserve.models.registry import ModelRegistry


@dataclass(frozen=True)
class Admitted:
    """What admission hands a route that runs a model: who asks, the hold on their key's
    quotas (None without quotas or keys), and the models to lease the body's from."""

    caller: Caller
    hold: Reservation | None
    models: ModelRegistry
    office: Office

    def lease(self, model: str | None = None, kind: str = "chat", load_only: bool = False):
        """The requested model's ModelHost, loaded and ready, for an `async with` block (see
        registry.py); 404 for an unknown name when several models are served, 503 while
        loading. A `load_only` lease (Ollama's load call, no prompt) switches models only
        for an admin."""
        return self.models.lease(model, kind, may_switch=not load_only or self.caller.is_admin,
                                 user=self.caller.key, allowed=self.caller.models)

    def keep_alive(self, model: str | None, seconds: float | None) -> list[str]:
        """Ollama's keep_alive of an accepted request (registry.keep_alive: a colleague's
        only lengthens a model's stay): ["keep_alive"] when it is not what the model now has,
        for X-Ignored-Fields."""
        if seconds is None or self.models.keep_alive(model, seconds, self.caller.is_admin):
            return []
        return ["keep_alive"]

    def user(self, body: SamplingBody) -> str | None:
        """Who is billed: the API key's name when keys are set, else the body's `user`."""
        return self.caller.user(body.user)

    def reserve_tokens(self, n: int) -> None:
        """What a submitted request may use at most, held against its key's token quotas."""
        if self.hold is None:
            return
        ledger = self.office.ledger
        try:
            self.hold.reserve_tokens(n, *_tokens_used(ledger, self.hold.key))
        except QuotaError as exc:
            raise _quota_refusal(ledger, self.hold.key, exc) from None


async def admit(request: Request) -> Admitted:
    """The one admission dependency of every router that runs a model (FastAPI solves it once
    per request; a route takes the result as `admitted: Admitted = Depends(admit)`): the key,
    then its rate, then its quota hold, each refusing before the body is read."""
    await require_key(request)
    await limit_rate(request)
    hold = hold_quota(request)
    state = request.app.state
    return Admitted(caller(request), hold, state.models, state.office)


# Routes whose requests wait for their turn within the rate instead of a 429: a document
# upload sends one embedding request per chunk at once (Open WebUI).
WAITS_ITS_TURN = ("/v1/embeddings", "/embeddings", "/api/embed", "/api/embeddings")
MAX_RATE_WAIT_S = 60.0
# A trusted frontend (--trust-user-header) as a whole: this many colleagues' --rate-limit.
FRONTEND_SCALE = 8


async def limit_rate(request: Request) -> None:
    """After the key check and before the body is validated: a key over its
    request rate (--rate-limit) gets 429 on every route it can reach, before any work, paced
    (rate_limit.py: a flood's refusals cost no more than its rate); embeddings wait their turn
    (up to MAX_RATE_WAIT_S) instead."""
    who = caller(request)
    limiter = request.app.state.rate_limiter
    if who.key is None or limiter is None:
        return
    max_wait = MAX_RATE_WAIT_S if request.url.path in WAITS_ITS_TURN else 0.0
    # a trusted frontend's colleague: their own rate, and the frontend's as a whole (names
    # it rotates are new colleagues, each with a full bucket, but never past that)
    buckets = [(who.key, 1)] + ([(who.frontend, FRONTEND_SCALE)] if who.frontend else [])
    wait = 0.0
    for name, scale in buckets:
        taken, waited = limiter.try_acquire(name, max_wait, scale)
        if not taken:
            raise OpenAIError(429, f"Too many requests from key '{name}': the limit is "
                              f"{limiter.rate * scale:g} per second (burst "
                              f"{limiter.burst * scale}). Retry in {waited:.1f} s.",
                              code="rate_limit_exceeded",
                              headers={"Retry-After": str(max(1, math.ceil(waited)))},
                              delay_s=limiter.refusal_delay(name, scale))
        wait = max(wait, waited)
    if wait > 0:
        await asyncio.sleep(wait)


def hold_quota(request: Request) -> Reservation | None:
    """[quotas] from the TOML, over one -> 429 saying which limit and when it resets. Holds a
    place in the key's quotas until the response ends (also kept as request.state.quota_hold
    for api/limits.py ReleaseReservations, which releases it however the response ends)."""
    keeper, ledger = request.app.state.quotas, request.app.state.office.ledger
    user = caller(request).key
    if keeper is None or user is None:
        return None
    try:
        hold = request.state.quota_hold = keeper.reserve(user, *_tokens_used(ledger, user))
    except QuotaError as exc:
        raise _quota_refusal(ledger, user, exc) from None
    return hold


def _tokens_used(ledger: Ledger | None, user: str) -> tuple[int, int]:
    return ledger.tokens_used(user) if ledger else (0, 0)


def _quota_refusal(ledger: Ledger | None, user: str, exc: QuotaError) -> OpenAIError:
    if ledger is not None:
        ledger.audit("quota", user, exc.limit)
    return OpenAIError(429, str(exc), code="quota_exceeded", param=exc.limit,
                       headers={"Retry-After": str(math.ceil(exc.retry_after_s))})
