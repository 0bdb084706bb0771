"""Why a request cannot have the model it asked for, in the model layer's words (raised by
registry.py). api/app.py answers each kind with its HTTP status, in one place."""

from __future__ import annotations


class ModelError(Exception):
    """message: one sentence for the client; code and param as OpenAI's errors carry them;
    retry_after: seconds after which trying again may succeed."""

    def __init__(self, message: str, code: str | None = None, param: str | None = "model",
                 retry_after: int | None = None):
        super().__init__(message)
        self.message, self.code, self.param, self.retry_after = message, code, param, retry_after


class UnknownModel(ModelError):
    """No model of that name is offered."""


class NotPermitted(ModelError):
    """The caller's key may not use this model (the key file's models= field)."""


class WrongKind(ModelError):
    """The model cannot do this (an embedding model asked to chat)."""


class NotEnoughMemory(ModelError):
    """Loading it would not fit beside the models that must stay."""


class ModelUnavailable(ModelError):
    """Not now: loading, failed to load, the server draining, or others' requests to finish."""
