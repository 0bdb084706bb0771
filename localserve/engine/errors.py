"""What the runner raises when llama.cpp refuses a batch. Its own module, so the engine loop
(and its tests, with a fake runner) can handle these without importing llama.cpp."""


class DecodeError(RuntimeError):
    """llama_decode refused a batch; the requests in it cannot continue."""


class RestoreFailed(DecodeError):
    """A cached prompt's state could not be loaded into its slot: its entry is forgotten."""

    def __init__(self, message: str, entry):
        super().__init__(message)
        self.entry = entry


class CacheFull(DecodeError):
    """llama_decode found no free cache cells for the batch (return code 1). Nothing was
    written, so the batch can be planned again after evicting a sequence."""


class Interrupted(DecodeError):
    """The step was stopped midway (Runner.interrupt: a chat arrived during a step of
    background tasks). Its cells were removed again, so the same rows are planned again; the
    states saved before it (`saved`, as in StepOutput) still go to the prompt cache."""

    def __init__(self, message: str, saved: list):
        super().__init__(message)
        self.saved = saved


class RowsRefused(DecodeError):
    """Some chunks of the step cannot be decoded for a reason of their own request's (an image
    it cannot place), found before anything was decoded: those requests end (`refused`, slot
    id -> why), the others' rows are planned again; `saved` as in Interrupted."""

    def __init__(self, refused: dict[int, str], saved: list):
        super().__init__("; ".join(sorted(set(refused.values()))))
        self.refused, self.saved = refused, saved


class EngineFailed(BaseException):
    """llama.cpp failed fatally (runner/aborts.py): the engine loop ends. A BaseException so
    that no per-request handler in the step catches it."""
