"""The engine's seams, as Protocols: what the scheduler needs of a vocabulary, what the loop
needs of a runner (the llama.cpp side, or a scripted fake in tests) and of an observer (the
metrics). Anything with these methods plugs in; nothing here imports llama.cpp."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from localserve.engine.request import Request, TokenEvent
    from localserve.engine.scheduler import StepPlan


class Vocab(Protocol):
    def piece(self, token: int) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...


class Runner(Vocab, Protocol):
    """Runs one StepPlan as one batch. decode() returns {slot_id: sampled token} for every
    chunk with sample=True, or raises errors.DecodeError (errors.CacheFull: retry after
    evicting a sequence)."""

    decode_seconds: float  # time inside llama_decode, for the overhead share in /slots
    sample_seconds: float

    def decode(self, plan: StepPlan) -> dict[int, int]: ...


class EngineObserver(Protocol):
    """Told about every step and every event, on the loop thread (keep it cheap)."""

    def on_step(self, plan: StepPlan, seconds: float) -> None: ...
    def on_event(self, request: Request, event: TokenEvent) -> None: ...
