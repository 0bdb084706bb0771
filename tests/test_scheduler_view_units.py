"""What the scheduler publishes (engine/scheduler_view.py), read without a server: every field
of a slot's, the queue's and the cache's view taken from the scheduler's own state at the time
asked, the stats a copy, and the fixed limits. /slots, /metrics and the dashboard read these
and nothing else of the scheduler."""

from __future__ import annotations

import dataclasses

from fakes import FakeVocab, PositionalRunner, step
from localserve.engine.prompt_cache import PromptCache
from localserve.engine.prompt_disk import DiskTier
from localserve.engine.request import Request, SamplingParams
from localserve.engine.scheduler import Scheduler
from localserve.engine.slots import SlotPool
from localserve.engine.snapshot import CacheView, RamCacheView, SlotView, WaitingView

T0 = 1000.0  # the requests' arrival times are set from here: the view's ages are exact


def request(rid: str, n_prompt: int, first: int, arrived: float, **kw) -> Request:
    r = Request(list(range(first, first + n_prompt)), SamplingParams(max_tokens=20, ignore_eos=True),
                request_id=rid, user=rid, **kw)
    r.arrival_time = arrived
    return r


def scheduler(tmp_path, disk: bool = True) -> Scheduler:
    tier = DiskTier(tmp_path / "prompts", 1 << 20, "test") if disk else None
    return Scheduler(SlotPool(300, 2, n_ctx_per_slot=300), FakeVocab(), 64,
                     prompt_cache=PromptCache(1 << 20, tier), max_num_seqs=2)


def test_each_slot_the_queue_and_the_cache_as_they_are_when_asked(tmp_path):
    sched, runner = scheduler(tmp_path), PositionalRunner(300)
    alice, bob = request("alice", 180, 1, T0), request("bob", 10, 500, T0 + 1)
    carol, dave = request("carol", 10, 700, T0 + 2.5), request("dave", 10, 800, T0 + 3.25)
    dave.preemptions = 1
    for r in (alice, bob, carol, dave):
        sched.add(r)
    for _ in range(3):
        step(sched, runner, sched.schedule())
    view = sched.view(T0 + 10)
    pool = sched.pool
    busy = {s.request.request_id: s for s in pool.slots if s.busy}
    assert set(busy) == {"alice", "bob"} and len(view.slots) == 2
    for slot, seen in zip(pool.slots, view.slots):
        r = slot.request
        assert seen == SlotView(
            id=slot.slot_id, state=slot.state.value, n_ctx=300, n_cached=slot.n_cached,
            n_guaranteed=150, n_borrowed=pool.borrowed(slot), request_id=r.request_id,
            user=r.request_id, n_prompt_tokens=len(r.prompt_tokens),
            n_decoded=len(r.output_tokens), cached_tokens=r.cached_tokens,
            prefix_source=r.prefix_source, age_s=round(T0 + 10 - r.arrival_time, 3),
            is_processing=True)
    assert view.slots[0].n_borrowed == busy["alice"].n_cached - 150 > 0
    assert view.queue_length == 2 and view.oldest_wait_s == 7.5
    assert view.waiting == (WaitingView("carol", "carol", 0, 7.5, False),
                            WaitingView("dave", "dave", 1, 6.75, True))
    used = sum(s.n_cached for s in pool.slots)
    cache = sched.prefixes.prompt_cache
    assert view.cache == CacheView(300, used, 150, busy["alice"].n_cached - 150, RamCacheView(
        1 << 20, cache.nbytes, len(cache.ram), 1 << 20, cache.disk_bytes, len(cache.on_disk),
        **dataclasses.asdict(cache.stats)))
    before = view.stats.steps
    step(sched, runner, sched.schedule())
    assert view.stats.steps == before < sched.stats.steps  # a copy: the view does not move
    assert view.draft_held == sched.drafts.acceptance.view()
    assert view.step_ms == sched.drafts.cost.view()


def test_an_idle_slot_an_empty_queue_and_no_prompt_cache(tmp_path):
    sched = Scheduler(SlotPool(300, 2, n_ctx_per_slot=300), FakeVocab(), 64)
    view = sched.view(T0)
    assert view.slots[1] == SlotView(
        id=1, state="idle", n_ctx=300, n_cached=0, n_guaranteed=150, n_borrowed=0,
        request_id=None, user=None, n_prompt_tokens=0, n_decoded=0, cached_tokens=0,
        prefix_source=None, age_s=None, is_processing=False)
    assert view.queue_length == 0 and view.oldest_wait_s == 0.0 and view.waiting == ()
    assert view.cache == CacheView(300, 0, 150, 0, None)
    without_disk = scheduler(tmp_path, disk=False).view(T0).cache.ram
    assert (without_disk.disk_max_bytes, without_disk.disk_bytes, without_disk.disk_entries) == (0, 0, 0)


def test_the_limits_are_the_pools_and_the_step_budgets():
    sched = Scheduler(SlotPool(300, 2, n_ctx_per_slot=200), FakeVocab(), 64, max_num_seqs=2)
    limits = sched.limits()
    assert (limits.ctx_size, limits.n_slots, limits.n_ctx_per_slot, limits.guarantee,
            limits.max_num_batched_tokens, limits.max_num_seqs) == (300, 2, 200, 150, 64, 2)
    assert limits.split == sched.pool.describe()
