"""EngineSnapshot: what the engine looked like after its last step, for everyone who watches.

Built by the engine loop after each step and swapped in by reference (immutable: frozen
dataclasses and tuples), so /slots, /metrics, /props and the dashboard read it at any time
without waiting for a step or taking a lock. Read it by attribute; its JSON form (the /slots
body) is produced in one place, to_json().
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

QUEUE_ROWS = 50  # waiting requests listed one by one


@dataclass(frozen=True)
class SlotView:
    id: int
    state: str  # "idle" | "prefill" | "decode"
    n_ctx: int  # the most one request may use here (the model's context, at most the pool)
    n_cached: int
    n_guaranteed: int  # cells this slot may always have: the pool split over the slots
    n_borrowed: int  # cells it holds beyond them, that a request within its guarantee takes back
    request_id: str | None
    user: str | None
    n_prompt_tokens: int
    n_decoded: int
    cached_tokens: int
    prefix_source: str | None  # where the cached tokens came from: "slot" or "ram"
    age_s: float | None
    is_processing: bool  # llama-server's name for "busy"


@dataclass(frozen=True)
class WaitingView:
    request_id: str
    user: str | None
    position: int
    wait_s: float
    preempted: bool


@dataclass(frozen=True)
class QueueView:
    waiting: int
    max_queue: int | None
    oldest_wait_s: float
    requests: tuple[WaitingView, ...]


@dataclass(frozen=True)
class CacheView:
    pool_tokens: int
    used_tokens: int
    guaranteed_per_slot: int
    borrowed_tokens: int
    ram: "RamCacheView | None"  # the prompt cache beyond the slots (--cache-ram), if on


@dataclass(frozen=True)
class RamCacheView:
    max_bytes: int
    bytes: int
    entries: int  # in RAM
    disk_max_bytes: int  # 0: no disk tier
    disk_bytes: int
    disk_entries: int
    hits: int
    misses: int
    saves: int
    evictions: int
    tokens_restored: int
    disk_writes: int
    disk_reads: int


@dataclass(frozen=True)
class EngineCounters:
    alive: bool
    failure: str | None
    steps: int
    tokens_batched: int
    last_step_tokens: int
    last_step_decode_rows: int
    last_step_ms: float
    max_decode_rows_in_step: int
    requests_finished: int
    requests_aborted: int  # the client went away
    requests_failed: int  # the server ended them (error, queue timeout, shutdown)
    preemptions: int  # the shared cache pool ran short
    share_preemptions: int  # a key gave a slot back to a waiting colleague
    borrow_preemptions: int  # a borrower gave cells back to a request within its guarantee
    task_preemptions: int  # a background task gave its slot or borrowed cells to a chat
    interrupted_steps: int  # steps of background tasks stopped for a chat that arrived
    prompt_tokens_computed: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    draft_tokens: int  # speculative decoding: drafts put into batches
    draft_tokens_accepted: int  # and kept
    draft_held: dict[str, float]  # how often a draft holds, by match length (drafts.py)
    step_ms: dict[int, float]  # a step's measured milliseconds, by batch rows (drafts.py)
    busy_s: float
    llama_decode_s: float
    sampling_s: float


@dataclass(frozen=True)
class EngineSnapshot:
    slots: tuple[SlotView, ...]
    queue: QueueView
    cache: CacheView
    engine: EngineCounters

    @property
    def running(self) -> int:
        return sum(1 for s in self.slots if s.state != "idle")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def build_snapshot(loop, plan=None) -> EngineSnapshot:
    """The loop's scheduler's view (scheduler_view.py) and the loop's own counters, on the loop
    thread between steps."""
    view = loop.scheduler.view(time.monotonic())
    stats = view.stats
    return EngineSnapshot(
        slots=view.slots,
        queue=QueueView(view.queue_length, loop.max_queue, view.oldest_wait_s, view.waiting),
        cache=view.cache,
        engine=EngineCounters(
            alive=loop.failure is None and not loop.stopping, failure=loop.failure,
            steps=stats.steps, tokens_batched=stats.tokens_batched,
            last_step_tokens=plan.num_tokens if plan else 0,
            last_step_decode_rows=plan.num_decode_rows if plan else 0,
            last_step_ms=round(loop.last_step_s * 1000, 2),
            max_decode_rows_in_step=stats.max_decode_rows_in_step,
            requests_finished=stats.requests_finished, requests_aborted=stats.requests_aborted,
            requests_failed=stats.requests_failed, preemptions=stats.preemptions,
            share_preemptions=stats.share_preemptions, borrow_preemptions=stats.borrow_preemptions,
            task_preemptions=stats.task_preemptions,
            interrupted_steps=stats.interrupted_steps,
            prompt_tokens_computed=stats.prompt_tokens_computed,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits, draft_tokens=stats.draft_tokens,
            draft_tokens_accepted=stats.draft_tokens_accepted,
            draft_held=view.draft_held, step_ms=view.step_ms,
            busy_s=round(loop.busy_seconds, 3),
            llama_decode_s=round(loop.llama_decode_s, 3), sampling_s=round(loop.sampling_s, 3)))
