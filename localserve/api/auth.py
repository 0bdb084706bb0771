"""API keys: `Authorization: Bearer KEY` (the OpenAI clients' way) or `X-Api-Key: KEY`.

A key's name is the request's identity: it takes turns in the fair queue, has its own shares
of the queue, the slots and the request rate, its own prefix cache, and shows in the
dashboard's user column and the logs. Keys are compared in constant time, as UTF-8 bytes on
both sides (HTTP headers arrive as bytes; Starlette hands them over decoded as latin-1).

Keys fail closed: a key file that yields no key stops start-up rather than serve without one.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import time
from dataclasses import dataclass

from fastapi import Request

from localserve.api.schemas import OpenAIError
from localserve.office.keys import KeyHolder


log = logging.getLogger("localserve")


class KeyChecker:
    def __init__(self, keys: dict[str, KeyHolder]):
        self._keys = [(k.encode("utf-8"), who) for k, who in keys.items()]

    def identify(self, request: Request) -> KeyHolder | None:
        """Whom the key names, None when no keys are configured; 401 when a key is wrong or
        missing."""
        if not self._keys:
            return None
        offered = _offered_key(request)
        if offered is None:
            raise OpenAIError(401, "Missing API key: send 'Authorization: Bearer YOUR_KEY' "
                              "(or 'X-Api-Key: YOUR_KEY').", "authentication_error", "missing_api_key")
        found = None
        for key, name in self._keys:  # compare with every key: time does not reveal which matched
            if hmac.compare_digest(key, offered):
                found = name
        if found is None:
            raise OpenAIError(401, "Incorrect API key provided.", "authentication_error",
                              "invalid_api_key")
        return found


def _offered_key(request: Request) -> bytes | None:
    """The key's raw bytes (headers are decoded as latin-1, which round-trips every byte)."""
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip().encode("latin-1")
    key = request.headers.get("x-api-key")
    return None if key is None else key.encode("latin-1")


@dataclass(frozen=True)
class Caller:
    """Who is asking, as require_key found out: the key's name, role and the models it may
    use (None: all). Without keys there is no name, and the one desktop user may see
    everything (role admin)."""

    key: str | None = None
    role: str = "admin"
    models: frozenset[str] | None = None
    frontend: str | None = None  # the trusted frontend's key a colleague's request came through

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def owner(self) -> str:
        """Whose stored chats and responses these are: the key's name, else the local user."""
        return self.key or "local"

    def user(self, body_user: str | None = None) -> str | None:
        """The name the ledger, shares and quotas use: the key's; without keys, what the
        body's `user` field says (OpenAI's end-user id)."""
        return self.key or body_user


NOBODY = Caller()


def caller(request: Request) -> Caller:
    """The request's Caller (NOBODY on the routes require_key does not guard)."""
    return getattr(request.state, "caller", NOBODY)


async def require_key(request: Request) -> None:
    """Router dependency: checks the key; records the Caller in request.state.caller."""
    try:
        who = request.app.state.keys.identify(request)
    except OpenAIError:
        ledger = request.app.state.office.ledger
        if ledger is not None:
            client = request.client.host if request.client else "?"
            REFUSALS.note(ledger, client, f"{request.method} {request.url.path}")
        raise
    request.state.caller = forwarded(request, Caller(*who)) if who else NOBODY


FORWARDED = ("x-openwebui-user-email", "x-openwebui-user-id", "x-openwebui-user-name")
NOT_IN_A_NAME = re.compile(r"[^\w.@+-]")


def forwarded(request: Request, frontend: Caller) -> Caller:
    """A trusted frontend's request for a colleague (--trust-user-header: Open WebUI forwards
    who is signed in, by e-mail, id and name): that colleague, as `frontend:colleague` (what a
    name may not hold changed as colleague_name says), with a user's role whatever the
    frontend key's. Any other key's headers are not read: a client cannot name itself."""
    if frontend.key not in request.app.state.office.settings.trusted_frontends:
        return frontend
    header = next((h for h in FORWARDED if request.headers.get(h, "").strip()), None)
    if header is None:  # the frontend's own requests (titles, tags): its key's
        return frontend
    return Caller(f"{frontend.key}:{colleague_name(request.headers[header].strip())}", "user",
                  frontend.models, frontend.key)


def colleague_name(raw: str) -> str:
    """A forwarded name as a key name: what a name may not hold becomes _, at most 64
    characters, and a short hash of the raw name whenever that changed it, so that names
    differing only there (o'brien@ and o_brien@, e-mails sharing their first 64 characters)
    stay two colleagues, who never read each other's stored answers."""
    cleaned = NOT_IN_A_NAME.sub("_", raw)[:64]
    if cleaned == raw:
        return cleaned
    return f"{cleaned}~{hashlib.sha256(raw.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"


class RefusalLog:
    """401s reach the audit log at most once a minute per client address, with the count of
    those held back since, and their paths cut short: a flood of bad keys (or of 15 KB paths)
    writes a bounded number of short rows, not one row per request."""

    EVERY_S = 60.0
    MAX_DETAIL = 200
    MAX_CLIENTS = 10_000

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._last: dict[str, tuple[float, int]] = {}  # client -> (row written at, held back)

    def note(self, ledger, client: str, what: str) -> None:
        now = self.clock()
        written, held = self._last.get(client, (None, 0))
        if written is not None and now - written < self.EVERY_S:
            self._last[client] = (written, held + 1)
            return
        if len(self._last) >= self.MAX_CLIENTS:
            self._last.clear()
        self._last[client] = (now, 0)
        more = f" (and {held} more from this address since the last row)" if held else ""
        ledger.audit("unauthorized", None, f"{client} {what}"[:self.MAX_DETAIL] + more)


REFUSALS = RefusalLog()


def is_admin(request: Request) -> bool:
    return caller(request).is_admin
