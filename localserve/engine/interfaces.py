"""The engine's seams, as Protocols: what the scheduler needs of a vocabulary, what the loop
needs of a scheduler, of a runner (the llama.cpp side, or a scripted fake in tests) and of an
observer (the metrics). Anything with these methods plugs in; nothing here imports llama.cpp."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from localserve.engine.finish import FinishReason
    from localserve.engine.request import Request, TokenEvent
    from localserve.engine.plan import StepOutput, StepPlan
    from localserve.engine.scheduler_view import PoolLimits, SchedulerView

    Delivery = list[tuple[Request, TokenEvent]]  # events for the loop to hand to their requests


class Vocab(Protocol):
    def piece(self, token: int) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...


class Runner(Vocab, Protocol):
    """Runs one StepPlan as one batch. decode() returns a StepOutput (a token for every chunk
    with sample=True), or raises errors.DecodeError (errors.CacheFull: retry after evicting a
    sequence; errors.Interrupted: plan the same rows again). interrupt(), from any thread,
    stops the decode in flight, or else the next one; forget_interrupt() drops one no decode
    has used yet."""

    def decode(self, plan: StepPlan) -> StepOutput: ...
    def interrupt(self) -> None: ...
    def forget_interrupt(self) -> None: ...
    def encode_ahead(self, images: list) -> None: ...  # on a thread of its own; `ready` after


class StepScheduler(Protocol):
    """All the engine loop asks of its scheduler (scheduler.Scheduler), on the loop thread.
    Once per step, in this order: schedule() plans the step's one batch; the runner decodes it;
    update(plan, output) takes the runner's whole StepOutput (tokens sampled, states saved,
    timings, grammar costs) and returns the events. When the decode raises instead, one of:
    restore_failed (a restored state did not fit: its admissions are placed again),
    cache_full (no cache room: one sequence evicted, the plan made again; False when none can
    be), interrupted (the step was stopped: its saves kept, its rows planned again), or fail
    (the batch's requests end with an error). Between steps: add, abort,
    drop_scope, expire_waiting. The loop reads nothing else (tests/test_layers.py checks).

    What the rest of the server reads of it comes out here too (vLLM's make_stats()): view()
    (slots, queue, cache, counters: scheduler_view.SchedulerView, for the snapshot), limits()
    (the pool's and the step's), grammar_refusal() (a key's grammar lately ended as too
    costly), and keep_sequences() (the slots' sequences into the prompt cache, once the loop
    has stopped)."""

    def add(self, request: Request) -> None: ...
    def abort(self, request_id: str, reason: FinishReason = ...,
              error: str | None = None) -> tuple[Request, TokenEvent] | None: ...
    def drop_scope(self, scope: str) -> int: ...
    def expire_waiting(self, max_wait_s: float, now: float) -> Delivery: ...
    def has_work(self) -> bool: ...
    def pending(self) -> list[Request]: ...
    def schedule(self) -> StepPlan: ...
    def update(self, plan: StepPlan, out: StepOutput) -> Delivery: ...
    def restore_failed(self, plan: StepPlan, entry: object) -> None: ...
    def cache_full(self) -> bool: ...
    def interrupted(self, plan: StepPlan, saved: list) -> None: ...
    def fail(self, plan: StepPlan, message: str) -> Delivery: ...
    def refused(self, plan: StepPlan, refused: dict[int, str], saved: list) -> Delivery: ...
    def view(self, now: float) -> SchedulerView: ...
    def limits(self) -> PoolLimits: ...
    def grammar_refusal(self, user: str | None, grammar: str | None) -> str | None: ...
    def keep_sequences(self, read_sequence) -> None: ...


class EngineObserver(Protocol):
    """Told about every step and every event, on the loop thread (keep it cheap)."""

    def on_step(self, plan: StepPlan, seconds: float) -> None: ...
    def on_event(self, request: Request, event: TokenEvent) -> None: ...


@dataclass(frozen=True)
class RunnerConfig:
    """What LlamaRunner is built from (ModelHost fills it from Settings)."""

    model_path: str
    ctx_size: int = 8192
    n_slots: int = 4
    n_batch: int = 512  # = --max-num-batched-tokens: the most tokens one step may carry
    n_threads: int | None = None
    n_gpu_layers: int | None = None  # None: all layers when the build can offload, else 0
    main_gpu: int = 0
    tensor_split: tuple[float, ...] = ()
    tensor_overrides: tuple[tuple[str, str], ...] = ()  # (pattern, buffer type): placement.py
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: str = "auto"
    swa_full: bool = False  # window layers keep every position (llama-server's --swa-full)
    kv_unified: bool = True  # one pool for every slot; False: a stream of ctx_size / n_slots each
    mmproj: str | None = None  # the model's projector: images in prompts (runner/images.py)
    draft_rollback: int = 0  # drafts a step where the cache cannot be cut back (--spec ngram)
