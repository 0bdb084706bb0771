"""The office: what one server shares across all its models. Keys and roles (and their reload
on SIGHUP), whose cached prompts a request may reuse, the ledger and audit log, the page's
conversations, the Responses API's stored answers, per-key counters, and the drain flag.

One per server, made by the registry; a model's engine (model_host.py) knows none of this: the
registry hands each host the observers (ledger, per-key counters) and the share rule it gets
from here. Rate limits and quotas are the HTTP layer's (api/admission.py), fed from here.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

from prometheus_client import CollectorRegistry

from localserve.common.config import Settings
from localserve.office.conversations import Conversations
from localserve.office.keys import KeyHolder, load_keys
from localserve.office.ledger import Ledger, LedgerObserver, state_dir
from localserve.common.metrics import KeyUsageMetrics

log = logging.getLogger("localserve")


class Office:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.key_registry = CollectorRegistry()  # per-key counters: admins only
        self.key_metrics = KeyUsageMetrics(self.key_registry)
        self.ledger: Ledger | None = None
        self.conversations: Conversations | None = None  # the web page's, per key
        self.responses: Conversations | None = None  # the Responses API's stored answers
        self.draining = False  # set on the first Ctrl-C/SIGTERM: new requests get 503
        self._keys: dict[str, KeyHolder] | None = None
        self._opening = threading.Lock()  # models load on their own threads

    # ---- who may ask -------------------------------------------------------------------
    @property
    def keys(self) -> dict[str, KeyHolder]:
        """{key: holder} from --api-key and --api-key-file (read once)."""
        if self._keys is None:
            self._keys = load_keys(self.settings)
        return self._keys

    @property
    def keys_enabled(self) -> bool:
        return bool(self.keys)

    def reload_keys(self) -> tuple[set[str], set[str]]:
        """Read the keys again (SIGHUP), audit what changed; returns the names (added,
        removed). Raises SettingsError and keeps the current keys when the file cannot be
        used. What a removed key cached is the caller's to drop (registry.drop_scope)."""
        new = load_keys(self.settings)
        old = {holder.name: (key, holder) for key, holder in self.keys.items()}
        now = {holder.name: (key, holder) for key, holder in new.items()}
        self._keys = new
        kept = old.keys() & now.keys()
        for event, names in (
                ("key_added", now.keys() - old.keys()), ("key_removed", old.keys() - now.keys()),
                ("key_rotated", {n for n in kept if old[n][0] != now[n][0]}),
                ("role_changed", {n for n in kept if old[n][1].role != now[n][1].role}),
                ("models_changed", {n for n in kept if old[n][1].models != now[n][1].models})):
            for name in sorted(names):
                detail = _change(event, old, now, name)
                log.info("SIGHUP: %s", " ".join(filter(None, (event.replace("_", " "), name,
                                                             detail))))
                if self.ledger is not None:
                    self.ledger.audit(event, name, detail)
        return set(now.keys() - old.keys()), set(old.keys() - now.keys())

    def cache_scope(self, user: str | None) -> str | None:
        """Whose cached prefixes a request may reuse: its key's own, unless keys are off (one
        desktop user) or --shared-prefix-cache says the team accepts what sharing leaks."""
        if not self.keys_enabled or self.settings.shared_prefix_cache:
            return None
        return user

    def unknown_names(self) -> list[str]:
        """Names in [quotas.*] and --trust-user-header that are no key's (a misspelt
        [quotas.bbo] would otherwise limit nobody, silently)."""
        names = {holder.name for holder in self.keys.values()}
        frontends = names & set(self.settings.trusted_frontends)
        quoted = [f"[quotas.{n}]" for n in self.settings.quotas if n != "default"
                  and n not in names and n.split(":", 1)[0] not in frontends]
        return quoted + [f"--trust-user-header {n}" for n in self.settings.trusted_frontends
                         if n not in names]

    def live_scope(self, scope: str | None) -> bool:
        """May a prompt kept from before under `scope` still be used: keys off, a current key,
        or a colleague of a trusted frontend (--trust-user-header)?"""
        if scope == self.cache_scope(None) or not self.keys_enabled:
            return True
        names = {holder.name for holder in self.keys.values()}
        return scope in names or scope.split(":", 1)[0] in (
            names & set(self.settings.trusted_frontends))

    # ---- what the models report to -----------------------------------------------------
    def observers(self, model_id: Callable[[], str]) -> list:
        """A model's engine observers beyond its own metrics: per-key counters (with keys) and
        the ledger (rows name the model by `model_id()`). Opens the state folder first."""
        self.open_state()
        observers: list = [self.key_metrics] if self.keys_enabled else []
        if self.ledger is not None:
            observers.append(LedgerObserver(self.ledger, model_id))
        return observers

    def state_dir(self) -> Path:
        return state_dir(self.settings)

    def open_state(self) -> None:
        """The ledger, the page's conversations and the stored responses: opened once, when the
        first model loads (server.check_state_dir has said what is wrong with the folder)."""
        s = self.settings
        with self._opening:
            if s.web and self.conversations is None:
                self.conversations = Conversations(self.state_dir())
            if self.responses is None:
                self.responses = Conversations(self.state_dir(), "responses.db")
            if s.ledger and self.ledger is None:
                self.ledger = Ledger(self.state_dir())
                log.info("ledger: %s", self.ledger.path)

    def close(self) -> None:
        """After every model has stopped (they write to the ledger until then)."""
        if self.ledger is not None:
            self.ledger.close()


def _change(event: str, old: dict, now: dict, name: str) -> str:
    """What the audit log says changed for `name`'s kept key ({name: (key, holder)} before and
    after; nothing for keys added, removed or rotated)."""
    if event == "role_changed":
        return f"{old[name][1].role} -> {now[name][1].role}"
    if event == "models_changed":
        return f"{_listed(old[name][1].models)} -> {_listed(now[name][1].models)}"
    return ""


def _listed(models: frozenset[str] | None) -> str:
    return "every model" if models is None else ",".join(sorted(models))
