"""What other threads post to the engine loop's inbox (loop.py); the loop applies them between
steps, the only thread that touches the slots and the prompt cache."""

from __future__ import annotations

from dataclasses import dataclass

from localserve.engine.request import Request


@dataclass(frozen=True)
class Add:
    request: Request


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Stop:
    """The loop ends; what still runs or waits fails (the drain waited for it first)."""


@dataclass(frozen=True)
class DropScope:
    scope: str  # a removed key's: its cached prompts go, in the prompt cache and idle slots
