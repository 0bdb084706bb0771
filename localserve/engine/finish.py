"""Why a request ended, and what each ending means outside the engine: the one table of its
HTTP status (answers and ledger rows) and of how the engine counts it."""

from __future__ import annotations

import enum


class FinishReason(str, enum.Enum):
    """Why a request ended. A str, so it compares and serialises as its OpenAI spelling."""

    STOP = "stop"  # end-of-generation token or a stop string
    LENGTH = "length"  # max_tokens or the slot's context
    TOOL_CALLS = "tool_calls"  # the answer is a complete tool call
    ABORT = "abort"  # the client went away (or cancelled): counted as aborted
    TIMEOUT = "timeout"  # waited past --queue-timeout without a slot: counted as failed
    ERROR = "error"  # the server could not go on (decode failure, shutdown): counted as failed
    GRAMMAR_COST = "grammar_cost"  # its grammar grew too costly to constrain (a neighbour's
    # pace is the price): ended by the runner's per-token bound, counted as failed

    def __str__(self) -> str:
        return self.value

    @property
    def completed(self) -> bool:
        """The answer ended normally (as opposed to aborted or failed)."""
        return self in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.TOOL_CALLS)

    @property
    def status(self) -> int:
        """The HTTP status this ending is answered with, and kept in the ledger with: the one
        table (499 is nginx's "client closed the request")."""
        return {"abort": 499, "timeout": 503, "error": 500, "grammar_cost": 400}.get(self.value, 200)
