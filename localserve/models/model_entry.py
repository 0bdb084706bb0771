"""One model's place in the registry: its lifecycle state (ModelState), its residency
(Entry: leases, idle time, keep_alive, memory), the card clients see and the 503 that says
why it cannot serve now."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from localserve.common.config import SettingsError
from localserve.common.model_errors import ModelUnavailable
from localserve.engine.runner import load_progress
from localserve.models.model_host import ModelHost
from localserve.models.model_specs import ModelSpec


class ModelState(str, enum.Enum):
    """A model's lifecycle, as llama.cpp's server-models.h names it, read in one place
    (Entry.state) from what its ModelHost holds:

        UNLOADED --first request--> LOADING --weights and cache ready--> LOADED
           ^                           |                                   |
           |                           +--load failed--> FAILED            |
           +------------ CLOSING <--idle, or making room for another ------+
    """

    UNLOADED = "unloaded"  # loads on the next request for it
    LOADING = "loading"
    LOADED = "loaded"
    CLOSING = "closing"  # being unloaded: its requests finish, new ones wait for the switch
    FAILED = "error"  # llama-server's word in /v1/models' status

    def __str__(self) -> str:
        return self.value

    @property
    def takes_requests(self) -> bool:
        """Loaded, or loadable on the next request (unloaded, or closing for a switch)."""
        return self in (ModelState.LOADED, ModelState.UNLOADED, ModelState.CLOSING)


@dataclass(eq=False)
class Entry:
    spec: ModelSpec
    host: ModelHost
    leases: int = 0  # requests that chose this model and are not yet in its engine
    last_busy: float = field(default_factory=time.monotonic)
    closing: bool = False  # being unloaded to make room: new requests wait for the switch
    yielding: int = 0  # switches waiting for it to go idle: its new requests wait behind them
    keep_alive: float | None = None  # a client's idle time before unloading (Ollama's
    # keep_alive; negative: never), else the server's --idle-unload
    need_bytes: int | None = None  # estimated memory: weights + cache
    loaded_at: float = field(default_factory=time.monotonic)  # its residency's start

    @property
    def loaded(self) -> bool:
        return self.host.engine is not None

    @property
    def busy(self) -> bool:
        loop = self.host.loop
        return self.leases > 0 or (loop is not None and loop.in_flight > 0)

    @property
    def state(self) -> ModelState:
        if self.closing and self.loaded:
            return ModelState.CLOSING
        if self.loaded:
            return ModelState.LOADED if self.host.ready else ModelState.FAILED
        if self.host.unloaded:
            return ModelState.UNLOADED
        return ModelState.FAILED if self.host.load_error else ModelState.LOADING

    @property
    def problem(self) -> str | None:
        """Why a FAILED model cannot serve: its load error, or its engine loop's end."""
        if self.state is not ModelState.FAILED:
            return None
        loop = self.host.loop
        return self.host.load_error or (loop.failure if loop else None) or "engine stopped"



def model_card(entry: Entry) -> dict:
    """OpenAI's model object, with llama-server's router `status` ({"value": "loaded"})."""
    try:
        created = int(entry.host.model_file.stat().st_mtime)
    except (SettingsError, OSError):
        created = 0
    status = {"value": str(entry.state)}
    if entry.state is ModelState.LOADING:  # one load at a time: llama.cpp's load progress is this one's
        status["progress"] = round(load_progress(), 2)
    settings = entry.host.settings
    return {"id": entry.spec.name, "aliases": settings.aliases or [entry.spec.name],
            "tags": settings.tags, "object": "model", "created": created,
            "owned_by": "localserve", "status": status, "kind": entry.spec.kind}


def ready(entry: Entry) -> ModelHost:
    """The model's host if it can take requests now (its ModelState: loaded, or unloaded and
    loadable again), else the 503 that says why."""
    state = entry.state
    if state.takes_requests:
        return entry.host
    if state is ModelState.LOADING:
        raise ModelUnavailable("the model is still loading; retry shortly", param=None,
                               retry_after=2)
    what = "the model failed to load" if entry.host.load_error else "the engine is not running"
    raise ModelUnavailable(f"{what}: {entry.problem}", param=None)
