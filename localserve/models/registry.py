"""Several models behind one address: each its own ModelHost (slots, scheduler, engine loop),
loaded on demand and unloaded when idle, within --max-loaded-models and --memory-budget.

Where a request finds its model: `async with registry.lease(name) as host:` in each route.
A lease lasts from choosing the model until the request is queued in its engine; from then on
the engine's in-flight count holds the model. A model is unloaded only when it has neither
(never under a running request: loading another model waits for it to go idle, the requests
for it queue meanwhile rather than being cut off).

CPU threads: each loaded model's llama.cpp context has -t threads; two models busy at the same
moment share the cores (the OS interleaves them), so on a small CPU one busy model at a time
(--max-loaded-models 1, or traffic that rarely overlaps) keeps each stream at full speed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from datetime import datetime, timezone

import psutil

from localserve.common.config import Settings
from localserve.engine.runner import supports_gpu_offload
from localserve.common.metrics import labelled_registry
from localserve.common.model_errors import (ModelUnavailable, NotEnoughMemory, NotPermitted,
                                            UnknownModel, WrongKind)
from localserve.models.model_entry import Entry, ModelState, model_card, ready
from localserve.models.model_specs import ModelSpec, model_specs, parse_size
from localserve.models.resources import GIB, OVERHEAD_BYTES, needs_at
from localserve.models.model_host import ModelHost
from localserve.office.office import Office

log = logging.getLogger("localserve.models")

# The longest a colleague's keep_alive keeps a model loaded once idle (their "-1", never,
# included): a model no one uses must still make room for another one eventually.
USER_KEEP_ALIVE_MAX_S = 3600.0
NEVER_EXPIRES = "2318-08-20T00:00:00+00:00"  # when Ollama says a kept-forever model expires


def permits(entry: Entry, allowed: frozenset[str] | None) -> bool:
    """May a key limited to the `allowed` names (None: unlimited) use `entry`, by its name or
    any of its aliases?"""
    return allowed is None or bool(allowed & {entry.spec.name, *entry.host.settings.aliases})


class ModelRegistry:
    """Every model the server offers, each a ModelHost in an Entry, and the office they share
    (office.py): the registry hands each host its observers and share rule from it."""

    def __init__(self, office: Office, primary: ModelHost, specs: list[ModelSpec]):
        self.office = office
        self.primary = primary
        s = office.settings
        self.entries = {specs[0].name: Entry(specs[0], primary)}
        for spec in specs[1:]:
            host = ModelHost(spec.settings(s), kind=spec.kind)
            host.unloaded = True  # loaded by the first request for it
            self.entries[spec.name] = Entry(spec, host)
        for entry in self.entries.values():
            entry.host.observers, entry.host.shares = office.observers, office.keys_enabled
            entry.host.live_scope = office.live_scope
            entry.host.arriving = lambda entry=entry: entry.leases  # prefilled together
        self.metrics_registry = labelled_registry(lambda: [
            (name, e.host.metrics_registry) for name, e in self.entries.items()])
        self.max_loaded = s.max_loaded_models
        self.budget = parse_size(s.memory_budget) if s.memory_budget else None
        self.idle_unload = s.idle_unload
        # Longest a request waits for another model's requests to finish before its model can
        # be loaded; meanwhile that model keeps serving its own. Past it: 503 + Retry-After.
        self.switch_timeout = s.model_switch_timeout
        # How long a busy model keeps serving after its load before a switch may take it
        # away (_residency): a third of the switch timeout, so a switch still fits in it.
        self.residency = s.model_switch_timeout / 3
        # A switch that took busy models away is charged to the key that asked for it
        # (_key_spacing): key -> when it ended. Entries older than the spacing are dropped.
        self.key_spacing = 2 * self.residency
        self.key_switched: dict[str | None, float] = {}
        self._switch_lock: asyncio.Lock | None = None  # one load or unload at a time

    @property
    def _switch(self) -> asyncio.Lock:
        if self._switch_lock is None:  # made in the event loop that uses it
            self._switch_lock = asyncio.Lock()
        return self._switch_lock

    @classmethod
    def from_settings(cls, settings: Settings) -> "ModelRegistry":
        specs = model_specs(settings)
        primary_settings = specs[0].settings(settings) if len(specs) > 1 else settings
        return cls(Office(settings), ModelHost(primary_settings, kind=specs[0].kind), specs)

    @classmethod
    def single(cls, host: ModelHost) -> "ModelRegistry":
        """A registry of one ready-made ModelHost (tests, and embedders of the app)."""
        name = (host.settings.aliases or [host.model_file.stem])[0]
        return cls(Office(host.settings), host, [ModelSpec(name, host.settings.model)])

    @property
    def several(self) -> bool:
        return len(self.entries) > 1

    # ---- choosing a model ------------------------------------------------------------
    def entry(self, name: str | None, allowed: frozenset[str] | None = None) -> Entry:
        """With one model, any name (many tools hard-code gpt-3.5-turbo); with several, the
        named one, the default when none is named, else 404 listing what exists. A 403 when
        it is not among the `allowed` names (a key's models; None: every model)."""
        if not self.several or name is None:
            found = next(iter(self.entries.values()))
        else:
            found = next((self.entries[known] for known in (name, name.removesuffix(":latest"))
                          if known in self.entries), None)  # Ollama: the tag defaults to latest
        if found is None:
            raise self.unknown(name, allowed)
        if not permits(found, allowed):
            raise NotPermitted(f"This API key may not use the model '{found.spec.name}'; it may "
                               f"use {', '.join(sorted(allowed)) or 'no model'}",
                               code="model_not_permitted")
        return found

    def unknown(self, name: str, allowed: frozenset[str] | None = None) -> UnknownModel:
        """The 404 for a name nobody serves, listing what exists (what `allowed` may see)."""
        served = [e.spec.name for e in self.visible(allowed)]
        return UnknownModel(f"The model '{name}' does not exist; this server serves "
                            f"{', '.join(served) or 'no model this key may use'}",
                            code="model_not_found")

    def visible(self, allowed: frozenset[str] | None = None) -> list[Entry]:
        """The models a key limited to `allowed` may use, and so see (None: every model)."""
        return [e for e in self.entries.values() if permits(e, allowed)]

    @asynccontextmanager
    async def lease(self, name: str | None, kind: str = "chat", may_switch: bool = True,
                    user: str | None = None, allowed: frozenset[str] | None = None):
        """The model's ModelHost, loaded, for the duration of the block (see the module doc).
        With `may_switch` False (a colleague's load call, with no prompt), a model that could
        only be loaded by unloading another stays unloaded: loading it would cost everyone on
        the loaded one their cached prompts, for no answer. `allowed`: as in entry()."""
        entry = self.entry(name, allowed)
        if self.office.draining:
            raise ModelUnavailable("the server is shutting down and takes no new requests",
                                   code="shutting_down", param=None, retry_after=10)
        if entry.spec.kind == "embedding" and kind != "embedding":
            raise WrongKind(f"'{entry.spec.name}' is an embedding model: use it with "
                            f"/v1/embeddings")
        if self.several and (may_switch or entry.loaded
                             or not self._victims(entry, await self._need(entry))):
            await self._ensure_loaded(entry, user)
        entry.leases += 1
        try:
            yield ready(entry)
        finally:
            entry.leases -= 1
            entry.last_busy = time.monotonic()

    async def _ensure_loaded(self, entry: Entry, user: str | None = None) -> None:
        """Wait until `entry` is loaded and takes new requests. A model another model's switch
        is waiting for takes none meanwhile (its running and queued requests finish): one
        key's sustained load on it cannot starve the switch."""
        deadline = time.monotonic() + self.switch_timeout
        while not (entry.loaded and not entry.closing and not entry.yielding):
            if entry.loaded and entry.yielding:  # bounded: the pending switch has a deadline
                await asyncio.sleep(0.05)
                continue
            if entry.state is ModelState.LOADING:  # the start-up load, or another request's
                await asyncio.to_thread(entry.host.loaded.wait, 1.0)
                continue
            if entry.state is ModelState.FAILED:
                ready(entry)  # the 503 naming why it failed to load
            if await self._key_spacing(user, entry):
                continue  # waited outside the switch lock: other keys' switches went on
            async with self._switch:
                if not entry.loaded:
                    await self._switch_to(entry, deadline, user)

    async def _switch_to(self, entry: Entry, deadline: float, user: str | None = None) -> None:
        """Make room (unloading idle models, least recently busy first, after waiting for
        their running requests), then load `entry`. Refused with the numbers if it can never
        fit; the loaded models are untouched then."""
        need = await self._need(entry)
        victims = self._victims(entry, need)
        free_after = psutil.virtual_memory().available + sum(v.need_bytes or 0 for v in victims)
        if self.primary.settings.memory_check and need + OVERHEAD_BYTES > free_after:
            raise NotEnoughMemory(f"The model '{entry.spec.name}' needs about {need / GIB:.2f} "
                                  f"GiB with its cache, but only {free_after / GIB:.2f} GiB would "
                                  f"be free; the loaded models keep running.",
                                  code="insufficient_memory")
        displaces_busy = any(v.busy for v in victims)
        if displaces_busy and self._spacing_left(user) > 0:
            return  # a victim became busy since _ensure_loaded looked: it waits there
        await self._residency(victims, entry)
        for victim in victims:
            victim.yielding += 1
        try:
            await self._unload(victims, entry, deadline)
        finally:
            for victim in victims:
                victim.yielding -= 1
        log.info("loading %s on demand", entry.spec.name)
        started = time.monotonic()
        await asyncio.to_thread(entry.host.load)
        self._charge_switch(user, entry, victims, time.monotonic() - started, displaces_busy)
        if entry.host.load_error:
            raise ModelUnavailable(f"the model '{entry.spec.name}' failed to load: "
                                   f"{entry.host.load_error}")
        entry.last_busy = entry.loaded_at = time.monotonic()

    def _charge_switch(self, user: str | None, entry: Entry, victims: list[Entry],
                       seconds: float, displaced_busy: bool) -> None:
        """A switch's cost goes on the record of the key whose request caused it (the audit
        log, `localserve usage --audit`): who makes everyone on the loaded model wait. One
        that took busy models away also counts against that key's next one (_key_spacing)."""
        now = time.monotonic()
        if displaced_busy:
            self.key_switched = {k: t for k, t in self.key_switched.items()
                                 if now - t < self.key_spacing}
            self.key_switched[user] = now
        if victims and self.office.ledger is not None:
            unloaded = ", ".join(v.spec.name for v in victims)
            self.office.ledger.audit("model_switch", user, f"{unloaded} -> {entry.spec.name}: "
                                     f"loaded in {seconds:.1f} s")

    async def _key_spacing(self, user: str | None, entry: Entry) -> bool:
        """A key whose switch took busy models away waits `key_spacing` (two residencies)
        after it before its next such switch; another key waits only for the residency. So
        one colleague alternating models costs those on the loaded one a switch per two
        residencies at most; requests for the loaded model go on being served meanwhile.
        Waited outside the switch lock: another key's switch to a third model does not wait
        behind it. True when it waited."""
        left = self._spacing_left(user)
        if left <= 0 or not any(v.busy for v in self._victims(entry, await self._need(entry))):
            return False
        log.info("%s waits %.1f s: this key switched models %.1f s ago", entry.spec.name,
                 left, self.key_spacing - left)
        await asyncio.sleep(left)
        return True

    def _spacing_left(self, user: str | None) -> float:
        return self.key_switched.get(user, -self.key_spacing) + self.key_spacing - time.monotonic()

    async def _residency(self, victims: list[Entry], entry: Entry) -> None:
        """A busy model keeps taking requests for `residency` seconds after its load before
        another model's switch makes it yield: requests for the other model wait meanwhile,
        and go together in one switch. So a colleague asking for another model now and then
        costs those on the loaded one one switch per residency at most, not one each time."""
        while True:
            left = max((v.loaded_at + self.residency - time.monotonic()
                        for v in victims if v.busy), default=0.0)
            if left <= 0:
                return
            log.info("%s waits %.1f s for the loaded model's residency", entry.spec.name, left)
            await asyncio.sleep(min(left, 0.25))

    async def _unload(self, victims: list[Entry], entry: Entry, deadline: float) -> None:
        """Wait (at most until `deadline`) for the victims' requests to finish, then unload
        them. They take no new requests meanwhile (Entry.yielding)."""
        while any(v.busy for v in victims):
            if time.monotonic() > deadline:
                raise ModelUnavailable(f"'{entry.spec.name}' waited {self.switch_timeout:g} s "
                                       f"for other models' requests to finish; retry shortly",
                                       code="model_switch_timeout", retry_after=10)
            await asyncio.sleep(0.05)
        for victim in victims:  # no await since the check above: none of them is busy
            victim.closing = True
        try:
            for victim in victims:
                log.info("unloading %s to make room for %s", victim.spec.name, entry.spec.name)
                await asyncio.to_thread(victim.host.unload)
        finally:
            for victim in victims:
                victim.closing = False

    async def _need(self, entry: Entry) -> int:
        if entry.need_bytes is None:
            s, path = entry.host.settings, str(entry.host.model_file)
            context = await asyncio.to_thread(entry.host.context_choice, path)
            needs = await asyncio.to_thread(needs_at, s, path, context, supports_gpu_offload())
            entry.need_bytes = needs["model_bytes"] + needs["kv_bytes"]
        return entry.need_bytes

    def _victims(self, entry: Entry, need: int) -> list[Entry]:
        loaded = [e for e in self.entries.values() if e.loaded and e is not entry]
        candidates = sorted((e for e in loaded if not e.spec.pin), key=lambda e: e.last_busy)
        victims: list[Entry] = []

        def over() -> bool:
            kept = [e for e in loaded if e not in victims]
            too_many = self.max_loaded is not None and len(kept) + 1 > self.max_loaded
            too_big = self.budget is not None and sum(e.need_bytes or 0 for e in kept) + need > self.budget
            return too_many or too_big

        while over():
            if not candidates:
                raise NotEnoughMemory(self._cannot_fit(entry, need, loaded),
                                      code="insufficient_memory")
            victims.append(candidates.pop(0))
        return victims

    def _cannot_fit(self, entry: Entry, need: int, loaded: list[Entry]) -> str:
        pinned = [e.spec.name for e in loaded if e.spec.pin]
        budget = f" --memory-budget {self.budget / GIB:.2f} GiB" if self.budget else ""
        return (f"The model '{entry.spec.name}' (about {need / GIB:.2f} GiB with its cache) cannot "
                f"be loaded within --max-loaded-models {self.max_loaded}{budget}"
                + (f" beside the pinned {', '.join(pinned)}" if pinned else "") + ".")

    # ---- unloading idle models ---------------------------------------------------------
    def keep_alive(self, name: str | None, seconds: float, admin: bool) -> bool:
        """Ollama's keep_alive: how long this model stays loaded once idle (0: unload after
        the request; negative: never). An admin's is taken as sent. A colleague's may only
        lengthen the stay, up to USER_KEEP_ALIVE_MAX_S ("never" included): a 0 from one key
        would otherwise unload the model others are using, and lose their cached prompts.
        With one model it stays: nothing could replace it. True when the model's stay is now
        the one asked for (the caller names keep_alive as ignored otherwise)."""
        if not self.several:
            return False
        entry = self.entry(name)
        if admin:
            entry.keep_alive = seconds
            return True
        now = self.idle_limit(entry)
        if now is None:  # never unloaded while idle: nothing a colleague could lengthen
            return seconds < 0
        asked = USER_KEEP_ALIVE_MAX_S if seconds < 0 else min(seconds, USER_KEEP_ALIVE_MAX_S)
        entry.keep_alive = max(now, asked)
        return entry.keep_alive == seconds

    def idle_limit(self, entry: Entry) -> float | None:
        """Seconds idle before `entry` is unloaded; None: never."""
        if entry.spec.pin or not self.several:
            return None
        limit = entry.keep_alive if entry.keep_alive is not None else (
            self.idle_unload if self.idle_unload > 0 else None)
        return None if limit is None or limit < 0 else limit

    def expires_at(self, entry: Entry) -> str:
        """When an idle `entry` will be unloaded (Ollama's /api/ps), as an ISO time."""
        limit = self.idle_limit(entry)
        if limit is None:  # never: Ollama's far future for keep_alive -1 (its longest duration)
            return NEVER_EXPIRES
        left = max(0.0, entry.last_busy + limit - time.monotonic())
        return datetime.fromtimestamp(time.time() + left, timezone.utc).isoformat()

    async def unload_idle_forever(self) -> None:
        """Every half second, unload models idle longer than their limit (idle_limit):
        --idle-unload, or the keep_alive a client asked for; never pinned ones."""
        if not self.several:
            return
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for entry in self.entries.values():
                limit = self.idle_limit(entry)
                if entry.busy:
                    entry.last_busy = now
                elif entry.loaded and limit is not None and now - entry.last_busy >= limit:
                    async with self._switch:
                        if entry.loaded and not entry.busy:
                            log.info("unloading %s: idle for %.0f s", entry.spec.name,
                                     now - entry.last_busy)
                            await asyncio.to_thread(entry.host.unload)
                            entry.keep_alive = None

    # ---- what clients and the dashboard see --------------------------------------------
    def cards(self, allowed: frozenset[str] | None = None) -> list[dict]:
        return [model_card(e) for e in self.visible(allowed)]

    # ---- the whole server ----------------------------------------------------------------
    def in_flight(self) -> int:
        """Requests accepted and not yet finished, over every model (what a drain waits for)."""
        return sum(entry.host.in_flight() for entry in self.entries.values())

    def stop_engines(self) -> None:
        """End every model's engine loop (a drain's end): unfinished requests get an error."""
        for entry in self.entries.values():
            entry.host.end_work()

    def drop_scope(self, user: str) -> None:
        """Forget what a removed key cached, in every model's slots and prompt cache: through
        a running engine's inbox (never from the signal handler's thread), else directly."""
        for entry in self.entries.values():
            loop = entry.host.loop
            if loop is not None and loop.is_alive():
                loop.drop_scope(user)
            elif entry.host.prompt_cache is not None:
                entry.host.prompt_cache.drop_scope(user)

    def stop(self) -> None:
        """Every model, then the office (the engines write to its ledger until they stop)."""
        for entry in self.entries.values():
            entry.host.stop()
        self.office.close()
