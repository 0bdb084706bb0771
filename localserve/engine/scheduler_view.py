"""What the scheduler publishes (vLLM's `SchedulerInterface.make_stats()`): one immutable view
of its slots, queue, cache and counters, built on the loop thread between steps by
Scheduler.view(), and its fixed limits (Scheduler.limits()). The snapshot and the model host
read these and nothing else of the scheduler: its bookkeepers stay its own."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from localserve.engine.scheduler_stats import SchedulerStats
from localserve.engine.snapshot import QUEUE_ROWS, CacheView, RamCacheView, SlotView, WaitingView


@dataclass(frozen=True)
class PoolLimits:
    ctx_size: int  # the pool's cells
    n_slots: int
    n_ctx_per_slot: int  # the most one request may use (the model's context, at most the pool)
    guarantee: int  # what each slot holds for sure; more is borrowed
    split: str  # the -c split, in words
    max_num_batched_tokens: int
    max_num_seqs: int
    drafts: bool  # whether decode rows get n-gram drafts (--spec, and the model's memory)


@dataclass(frozen=True)
class SchedulerView:
    slots: tuple[SlotView, ...]
    queue_length: int
    oldest_wait_s: float
    waiting: tuple[WaitingView, ...]  # the first QUEUE_ROWS, in order
    cache: CacheView
    stats: SchedulerStats  # a copy: the scheduler's own goes on counting
    draft_held: dict[str, float]  # how often a draft holds, by match length (drafts.py)
    step_ms: dict[int, float]  # a step's measured milliseconds, by batch rows (drafts.py)


def view_of(sched, now: float) -> SchedulerView:
    pool, waiting = sched.pool, sched.waiting
    oldest = waiting.oldest_arrival()
    return SchedulerView(
        slots=tuple(_slot_view(slot, pool, now) for slot in pool.slots),
        queue_length=len(waiting), oldest_wait_s=round(now - oldest, 3) if oldest else 0.0,
        waiting=tuple(WaitingView(r.request_id, r.user, i, round(now - r.arrival_time, 3),
                                  r.preemptions > 0) for i, r in zip(range(QUEUE_ROWS), waiting)),
        cache=CacheView(pool.ctx_size, pool.used, pool.guarantee,
                        sum(pool.borrowed(s) for s in pool.slots),
                        _ram_view(sched.prefixes.prompt_cache)),
        stats=dataclasses.replace(sched.stats), draft_held=sched.drafts.acceptance.view(),
        step_ms=sched.drafts.cost.view())


def limits_of(sched) -> PoolLimits:
    pool = sched.pool
    return PoolLimits(pool.ctx_size, len(pool.slots), pool.n_ctx_per_slot, pool.guarantee,
                      pool.describe(), sched.budget, sched.max_num_seqs,
                      sched.drafts.speculative)


def _ram_view(cache) -> RamCacheView | None:
    if cache is None:
        return None
    return RamCacheView(cache.max_bytes, cache.nbytes, len(cache.ram),
                        cache.disk.max_bytes if cache.disk else 0, cache.disk_bytes,
                        len(cache.on_disk), **dataclasses.asdict(cache.stats))


def _slot_view(slot, pool, now: float) -> SlotView:
    req = slot.request
    return SlotView(
        id=slot.slot_id, state=slot.state.value, n_ctx=slot.n_ctx, n_cached=slot.n_cached,
        n_guaranteed=pool.guarantee, n_borrowed=pool.borrowed(slot),
        request_id=req.request_id if req else None, user=req.user if req else None,
        n_prompt_tokens=req.num_prompt_tokens if req else 0,
        n_decoded=req.num_output_tokens if req else 0,
        cached_tokens=req.cached_tokens if req else 0,
        prefix_source=req.prefix_source if req else None,
        age_s=round(now - req.arrival_time, 3) if req else None, is_processing=req is not None)
