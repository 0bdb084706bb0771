"""The one pool, pure (slots.py, scheduler.py): guarantees, borrowing, and preempting a
borrower to the prompt cache, against fakes.PositionalRunner, which keeps llama.cpp's
sequences in one pool of cells (saves, restores, trims, a batch that does not fit fails)."""

import pytest

from fakes import FakeVocab, PositionalRunner, assert_pool_tally
from localserve.engine.plan import StepOutput
from localserve.engine.prompt_cache import PromptCache
from localserve.engine.request import Request, RequestStatus, SamplingParams
from localserve.engine.scheduler import Scheduler
from localserve.engine.slots import SlotPool


def request(rid, n_prompt, max_tokens, first=1, user=None):
    return Request([first + i % 20 for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens),
                   request_id=rid, user=user)


def pool_scheduler(pool=200, slots=2, cache=True, budget=64):
    return Scheduler(SlotPool(pool, slots, n_ctx_per_slot=pool), FakeVocab(), budget,
                     prompt_cache=PromptCache(1 << 20) if cache else None)


def run(sched, runner, arrivals, steps=2000):
    """Step until idle; `arrivals` maps a step number to requests added before it."""
    out, finish = {}, {}
    for n in range(steps):
        for r in arrivals.get(n, []):
            sched.add(r)
            out[r.request_id] = []
        if not sched.has_work() and n > max(arrivals):
            return out, finish
        plan = sched.schedule()
        for r, ev in sched.update(plan, runner.decode(plan)):
            out[r.request_id].extend(ev.token_ids)
            if ev.finished:
                finish[r.request_id] = ev.finish_reason
    raise AssertionError("did not finish")


def alone(make_request):
    sched, runner = pool_scheduler(pool=10_000), PositionalRunner(10_000)
    return run(sched, runner, {0: [make_request()]})[0]


def test_one_request_may_borrow_past_its_guarantee_up_to_the_pool():
    pool = SlotPool(200, 2, n_ctx_per_slot=200)
    assert pool.guarantee == 100 and pool.n_ctx_per_slot == 200
    assert SlotPool(200, 2).n_ctx_per_slot == 100  # without n_ctx_per_slot: held to its share
    sched, runner = pool_scheduler(), PositionalRunner(200)
    out, _ = run(sched, runner, {0: [request("big", 150, 30)]})
    assert len(out["big"]) == 30 and runner.max_used > 150


def test_the_pools_used_cells_and_running_slots_follow_every_change_of_a_slot():
    """SlotPool.used and .running are kept by the slots as they change, not summed when asked:
    a prefix kept, a copy or restore taken in, tokens computed, a sequence cleared, a slot
    released with its cache (what every chunk's room and every rule's slots are read from)."""
    pool = SlotPool(200, 3, n_ctx_per_slot=200)
    a, b, c = pool.slots
    steps = [lambda: a.assign(request("a", 5, 9), keep=0, admitted_seq=1),
             lambda: a.computed([1, 2, 3, 4, 5]),
             lambda: b.assign(request("b", 9, 9), keep=3, admitted_seq=2, copied=[1, 2, 3, 4]),
             lambda: b.computed([7, 8]),
             lambda: a.release(),
             lambda: c.assign(request("c", 9, 9), keep=2, admitted_seq=3, copied=[5, 6, 7],
                              restored=True),
             lambda: b.forget(),
             lambda: a.assign(request("d", 9, 9), keep=4, admitted_seq=4)]
    for change in steps:
        change()
        assert_pool_tally(pool)
        assert pool.free == 200 - pool.used
    assert [s.n_cached for s in pool.slots] == [4, 0, 2]
    assert pool.running == [a, b, c]


def test_prompts_that_outgrow_the_pool_together_never_get_more_rows_than_it_has_free():
    """Three prompts admitted while they fit, then all computing at once in 200 cells: each
    step's chunks share the room left (Scheduler._chunks counts it down chunk by chunk), so no
    batch is planned past the free cells (the runner would find the cache full), and every
    answer completes."""
    sched, runner = pool_scheduler(pool=200, slots=3, cache=False), PositionalRunner(200)
    requests = [request("a", 90, 30), request("b", 70, 30, first=3), request("c", 60, 30, first=5)]
    for r in requests:
        sched.add(r)
    for _ in range(400):
        if not sched.has_work():
            break
        plan = sched.schedule()
        assert plan.num_tokens <= sched.pool.free
        sched.update(plan, runner.decode(plan))
        assert_pool_tally(sched.pool)
    assert [len(r.output_tokens) for r in requests] == [30, 30, 30]


def test_a_stream_per_slot_holds_its_share_and_keeps_an_idle_sequence_where_it_is():
    """--no-kv-unified: nothing borrowed (at most the share, or the trained context below
    it), and an idle slot's sequence stays in its stream (it costs the others nothing), where
    one pool parks it in the prompt cache once a step computes for someone else."""
    assert SlotPool(200, 2, n_ctx_per_slot=200, streams=True).n_ctx_per_slot == 100
    assert SlotPool(200, 2, n_ctx_per_slot=60, streams=True).n_ctx_per_slot == 60
    for streams, parked in ((True, 0), (False, 1)):
        pool = SlotPool(200, 2, n_ctx_per_slot=200, streams=streams)
        sched = Scheduler(pool, FakeVocab(), 64, prompt_cache=PromptCache(1 << 20))
        runner = PositionalRunner(200)
        run(sched, runner, {0: [request("first", 40, 4)]})
        run(sched, runner, {0: [request("second", 40, 4, first=40)]})
        assert sched.prefixes.prompt_cache.stats.saves == parked
        assert all(s.n_cached for s in pool.slots) == (not parked)


def test_a_borrower_gives_its_cells_back_to_a_request_within_its_guarantee_and_resumes_by_restoring():
    big = lambda: request("big", 150, 30)  # noqa: E731  borrows 80 cells past its 100
    small = lambda: request("small", 60, 10, first=40)  # noqa: E731  within its guarantee
    expected = {**alone(big), **alone(small)}
    sched, runner = pool_scheduler(), PositionalRunner(200)
    out, _ = run(sched, runner, {0: [big()], 5: [small()]})
    assert out == expected  # the same tokens as alone: nothing lost, nothing repeated
    assert sched.stats.borrow_preemptions == 1 and sched.stats.preemptions == 0
    assert runner.restored >= 150  # restored from the prompt cache, not recomputed
    assert sched.prefixes.prompt_cache.stats.tokens_restored >= 150


def test_a_request_over_its_guarantee_waits_and_takes_nothing_back():
    big, other = request("big", 150, 30), request("other", 120, 5, first=40)
    sched, runner = pool_scheduler(), PositionalRunner(200)
    run(sched, runner, {0: [big], 5: [other]})
    assert sched.stats.borrow_preemptions == 0


def test_when_the_pool_runs_short_the_biggest_borrower_goes_before_the_newest_sequence():
    sched = pool_scheduler(pool=300, slots=3, cache=False)
    sched.add(request("old_big", 120, 100))  # borrows past its 100
    sched.add(request("mid", 30, 100, first=40))
    sched.add(request("newest", 30, 100, first=60))
    runner = PositionalRunner(300)
    for _ in range(60):
        plan = sched.schedule()
        sched.update(plan, runner.decode(plan))
        if sched.stats.preemptions:
            break
    assert sched.stats.preemptions == 1
    waiting = [r.request_id for r in sched.waiting]
    assert waiting == ["old_big"]


def test_a_preemption_after_a_failed_batch_saves_the_sequence_with_the_next_plan():
    """preempt_newest (llama_decode found no room): its save and drop wait for the next
    plan, and the runner reads the sequence before clearing it."""
    sched = pool_scheduler(pool=400, slots=2)
    sched.add(request("a", 40, 50))
    sched.add(request("b", 40, 50, first=40))
    runner = PositionalRunner(400)
    for _ in range(5):
        plan = sched.schedule()
        sched.update(plan, runner.decode(plan))
    assert sched.cells.preempt_newest()
    plan = sched.schedule()
    assert plan.dropped and [s.slot_id for s in plan.saves] == plan.dropped
    out = runner.decode(plan)
    assert out.saved and out.saved[0][1] == out.saved[0][0].tokens


def test_an_idle_slots_prefix_dropped_for_room_is_saved_first():
    sched, runner = pool_scheduler(pool=200, slots=2), PositionalRunner(200)
    run(sched, runner, {0: [request("first", 90, 4)]})
    out, _ = run(sched, runner, {0: [request("wide", 150, 4, first=40)]})
    assert len(out["wide"]) == 4 and runner.max_used <= 200
    assert sched.prefixes.prompt_cache.stats.saves == 1  # first's 93 cells, before they were cleared


@pytest.mark.parametrize("n_prompt", [199, 250])
def test_a_prompt_past_what_one_request_may_use_is_refused_naming_it(n_prompt):
    sched = pool_scheduler()
    with pytest.raises(ValueError, match="200 tokens one request may use"):
        sched.add(request("huge", n_prompt + 1, 4))


def test_update_takes_the_whole_step_output():
    sched, runner = pool_scheduler(), PositionalRunner(200)
    sched.add(request("a", 10, 2))
    plan = sched.schedule()
    events = sched.update(plan, StepOutput({plan.chunks[0].slot_id: [3]}, decode_s=0.01,
                                           sample_s=0.005))
    assert events and events[0][1].token_ids == (3,)
    assert sched.drafts.cost.view() == {}  # a prompt's step prices no draft (reuse.py)
    plan = sched.schedule()
    sched.update(plan, StepOutput({plan.chunks[0].slot_id: [4]}, decode_s=0.01, sample_s=0.005))
    assert plan.num_tokens == 1
    assert sched.drafts.cost.view() == {1: 15.0}  # a decode row: its decode and its sampling


def test_a_request_aborted_while_its_step_ran_is_skipped_and_the_others_get_their_tokens():
    sched = pool_scheduler(pool=400, slots=2)
    sched.add(request("a", 10, 5))
    sched.add(request("b", 10, 5, first=40))
    plan = sched.schedule()
    assert [c.request.request_id for c in plan.chunks] == ["a", "b"]
    sched.abort("a")  # between the plan and the runner's output
    events = sched.update(plan, PositionalRunner(400).decode(plan))
    assert [r.request_id for r, _ in events] == ["b"] and sched.stats.prompt_tokens_computed == 10


def test_a_keys_one_large_request_is_never_preempted_for_its_share():
    """Three slots, one each at most while others wait: alice's one request borrowed two
    guarantees' worth, over her share by itself. Bob's arrival finds room beside it and takes
    nothing from it: one request may use the whole pool (saved and restored at every other
    arrival, a long document took twice its steps)."""
    sched = Scheduler(SlotPool(300, 3, n_ctx_per_slot=300), FakeVocab(), 64, slot_share=1,
                      prompt_cache=PromptCache(1 << 20))
    runner = PositionalRunner(300)
    sched.add(request("alice", 150, 60, user="alice"))
    for _ in range(4):
        plan = sched.schedule()
        sched.update(plan, runner.decode(plan))
    assert sched.shares.held()["alice"] == 2
    for n in range(3):  # colleagues' chats come and go
        sched.add(request(f"bob{n}", 20, 2, first=40, user="bob"))
        for _ in range(4):
            plan = sched.schedule()
            sched.update(plan, runner.decode(plan))
    assert sched.stats.share_preemptions == 0 and sched.stats.preemptions == 0
    assert any(s.request is not None and s.request.request_id == "alice" for s in sched.pool.slots)


def test_a_key_over_its_share_gives_back_its_newest_request_but_not_its_largest():
    """Alice holds her large request and, newer, a small one: over her share while bob waits,
    the small one goes back to the queue."""
    sched = Scheduler(SlotPool(300, 3, n_ctx_per_slot=300), FakeVocab(), 64, slot_share=1,
                      prompt_cache=PromptCache(1 << 20))
    runner = PositionalRunner(300)
    sched.add(request("large", 150, 60, user="alice"))
    sched.add(request("small", 10, 60, user="alice"))
    for _ in range(4):
        plan = sched.schedule()
        sched.update(plan, runner.decode(plan))
    sched.add(request("bob", 20, 5, first=40, user="bob"))
    plan = sched.schedule()
    assert sched.stats.share_preemptions == 1
    running = {s.request.request_id for s in sched.pool.slots if s.request is not None}
    assert "large" in running and "small" not in running


def test_a_restore_llama_cpp_refuses_puts_the_request_back_to_be_computed():
    """RestoreFailed (no room where llama.cpp needs the state): the entry is forgotten, the
    admission taken back and placed again at once, computing what the entry held."""
    sched, runner = pool_scheduler(pool=400, slots=1), PositionalRunner(400)
    first = lambda: request("a", 60, 3)  # noqa: E731
    expected = alone(first)
    run(sched, runner, {0: [first()]})
    run(sched, runner, {0: [request("b", 60, 3, first=40)]})  # a's sequence saved, b's in the slot
    again = first()
    sched.add(again)
    plan = sched.schedule()
    [admission] = plan.admitted
    assert admission.restore is not None
    admitted_at = again.admitted_time
    assert admitted_at is not None
    sched.restore_failed(plan, admission.restore)  # instead of runner.decode(plan)
    assert not sched.pool.slots[0].busy and list(sched.waiting) == [again]
    assert again.status is RequestStatus.WAITING
    plan = sched.schedule()
    assert plan.dropped == [0] and plan.admitted[0].restore is None
    assert again.admitted_time == admitted_at  # its wait for a slot ended at the first
    assert plan.admitted[0].kept_tokens == 0  # b's cells do not match: computed from scratch
    sched.update(plan, runner.decode(plan))
    while sched.has_work():
        plan = sched.schedule()
        sched.update(plan, runner.decode(plan))
    assert again.output_tokens == expected["a"] and again.cached_tokens == 0


def test_a_restore_is_admitted_only_with_room_for_the_whole_saved_sequence():
    """A 180-token conversation is saved; a question sharing its first 60 tokens comes while
    another request holds up to 170 cells of 300: the saved state is written whole before it
    is cut to the shared prefix, so it waits for 180 free cells, not 61 (the fake runner
    refuses a restore without room, as llama.cpp does)."""
    sched, runner = pool_scheduler(pool=300, slots=2), PositionalRunner(300)
    run(sched, runner, {0: [request("long", 180, 2)]})  # slot 0
    run(sched, runner, {0: [request("filler", 20, 2, first=60)]})  # slot 1, used last
    out, finish = run(sched, runner, {0: [request("other", 130, 40, first=40)],  # overwrites 0
                                      3: [request("short", 61, 2)]})
    assert sched.prefixes.prompt_cache.stats.tokens_restored == 60  # short restored long's prefix
    assert set(finish) == {"other", "short"} and runner.max_used <= 300


# ---- PoolKeeper.reclaim_guarantee at its exact bounds ----------------------------------------

def keeper(pool_size, n_slots, *held):
    """A PoolKeeper whose first slots run decoding requests holding `held` cells each."""
    from localserve.engine.pool_keeper import PoolKeeper
    from localserve.engine.reuse import PrefixBook
    from localserve.engine.scheduler_stats import SchedulerStats
    from localserve.engine.waiting import FairQueue

    pool = SlotPool(pool_size, n_slots, n_ctx_per_slot=pool_size)
    for i, n in enumerate(held):
        running = Request(list(range(1, n + 1)), SamplingParams(max_tokens=50), request_id=f"r{i}")
        pool.slots[i].assign(running, 0, i + 1)
        pool.slots[i].computed(running.prompt_tokens)
        running.output_tokens.append(5)  # decoding: one cell wanted this step
    stats = SchedulerStats()
    return PoolKeeper(pool, PrefixBook(pool, None), FairQueue(), stats)


def asking(n):
    return Request(list(range(100, 100 + n)), SamplingParams(max_tokens=4), request_id="new")


@pytest.mark.parametrize("n_prompt, preempted", [(99, 1), (100, 0)])
def test_a_request_is_owed_cells_up_to_exactly_its_guarantee(n_prompt, preempted):
    cells = keeper(200, 2, 150)  # guarantee 100; the prompt and its next token need n + 1
    reserved = cells.reclaim_guarantee(cells.carried_over([]), asking(n_prompt))
    assert cells.stats.borrow_preemptions == preempted
    assert reserved == (n_prompt + 1 if preempted else 0)


@pytest.mark.parametrize("n_prompt, preempted", [(48, 0), (49, 1)])
def test_reclaiming_counts_the_decoding_rows_exactly(n_prompt, preempted):
    cells = keeper(200, 2, 150)  # 50 free; the borrower's next row takes one of them
    cells.reclaim_guarantee(cells.carried_over([]), asking(n_prompt))
    assert cells.stats.borrow_preemptions == preempted


def test_an_idle_prefix_goes_before_a_borrower_and_the_biggest_borrower_first():
    cells = keeper(300, 3, 150)
    idle = cells.pool.slots[1]
    idle.computed(list(range(100)))  # a kept prefix, no request
    plan = cells.carried_over([])
    cells.reclaim_guarantee(plan, asking(60))
    assert plan.dropped == [1] and cells.stats.borrow_preemptions == 0
    cells = keeper(400, 4, 250, 120)
    plan = cells.carried_over([])
    cells.reclaim_guarantee(plan, asking(99))
    assert plan.dropped == [0] and cells.pool.slots[1].busy  # 150 borrowed went, not 20


def test_nothing_is_kept_back_without_a_request_or_a_free_slot():
    cells = keeper(200, 2, 150, 40)
    assert cells.reclaim_guarantee(cells.carried_over([]), asking(10)) == 0  # no slot free
    idle_one = keeper(200, 2, 150)
    assert idle_one.reclaim_guarantee(idle_one.carried_over([]), None) == 0


@pytest.mark.parametrize("n_prompt, dropped", [(59, []), (60, [0])])
def test_an_idle_prefix_is_dropped_only_when_the_prompt_and_its_first_token_do_not_fit(
        n_prompt, dropped):
    """100 cells, an idle slot keeps a 40-token prefix: a new prompt needs its tokens and one
    for its first answer token. 59 + 1 fit beside the prefix exactly; 60 + 1 take it."""
    sched, runner = pool_scheduler(pool=100, slots=2, cache=False, budget=256), PositionalRunner(100)
    run(sched, runner, {0: [request("kept", 40, 1, first=100)]})
    assert [s.n_cached for s in sched.pool.slots] == [40, 0]
    sched.add(request("new", n_prompt, 1))
    plan = sched.schedule()
    assert plan.dropped == dropped and [a.slot_id for a in plan.admitted] == [1]


def test_a_sibling_choices_copied_prefix_takes_cells_of_its_own_in_the_pool():
    """n > 1: the second choice copies the first's prompt from its slot. Its slot's own old
    prefix goes, but the copy takes as many cells as it holds (the pool counts each slot's
    cells): the room for it was once counted without them, the pool went 11 cells past full,
    and the batch failed (CacheFull). Now an idle prefix makes room first."""
    sched, runner = pool_scheduler(pool=100, slots=3, cache=False, budget=256), PositionalRunner(100)
    run(sched, runner, {0: [request("c", 20, 1, first=200)]})
    run(sched, runner, {0: [request("b", 30, 1, first=100)]})
    first = request("a", 41, 5)
    sibling = Request(list(first.prompt_tokens), SamplingParams(max_tokens=5), request_id="a2",
                      prefix_of=first)
    sched.add(first)
    sched.add(sibling)
    while sched.has_work():
        plan = sched.schedule()
        assert sched.pool.free >= 0
        sched.update(plan, runner.decode(plan))  # CacheFull here before
    assert len(sibling.output_tokens) == 5 and sibling.cached_tokens == 40


def task(rid, n_prompt, max_tokens, first=1, user="bob"):
    r = request(rid, n_prompt, max_tokens, first, user)
    r.background = True
    return r


def step(sched, runner, n=1):
    for _ in range(n):
        plan = sched.schedule()
        sched.update(plan, runner.decode(plan))


def running_ids(sched):
    return {s.request.request_id for s in sched.pool.slots if s.request is not None}


def test_a_colleagues_document_takes_back_the_cells_background_tasks_borrowed():
    """Two keys' requests dressed as a frontend's titles borrow most of the pool; a colleague's
    document over its guarantee (so no borrower owes it cells) does not fit what is left: the
    task borrowing most gives its cells back at once (366 steps of waiting before), and both
    tasks still end with the tokens they would have alone."""
    sched = Scheduler(SlotPool(600, 6, n_ctx_per_slot=600), FakeVocab(), 64, slot_share=5,
                      prompt_cache=PromptCache(1 << 20))
    runner = PositionalRunner(600)
    sched.add(task("t1", 240, 120))
    sched.add(task("t2", 230, 120, first=30, user="dave"))  # each key within its share
    step(sched, runner, 40)
    assert running_ids(sched) == {"t1", "t2"} and sched.pool.free < 150
    out = {"t1": [], "t2": [], "doc": []}
    sched.add(request("doc", 150, 5, first=60, user="carol"))
    for n in range(400):
        if not sched.has_work():
            break
        plan = sched.schedule()
        if n == 0:
            assert "doc" in running_ids(sched)
        for r, ev in sched.update(plan, runner.decode(plan)):
            out[r.request_id].extend(ev.token_ids)
    assert sched.stats.task_preemptions == 1  # the task borrowing most, once
    assert out["doc"] == alone(lambda: request("doc", 150, 5, first=60, user="carol"))["doc"]
    t1 = alone(lambda: task("t1", 240, 120))["t1"]
    assert out["t1"] == t1[len(t1) - len(out["t1"]):]  # its first tokens came before "doc"


def test_a_background_task_counts_in_its_keys_slot_share():
    """Alice's title holds one slot, her share: her chat waits while bob's, queued after it,
    takes the free slot (a task claimed no share, and alice's chat went first)."""
    sched = Scheduler(SlotPool(400, 2, n_ctx_per_slot=400), FakeVocab(), 64, slot_share=1,
                      prompt_cache=PromptCache(1 << 20))
    runner = PositionalRunner(400)
    sched.add(task("title", 20, 50, user="alice"))
    step(sched, runner)
    sched.add(request("alice-chat", 20, 5, first=40, user="alice"))
    sched.add(request("bob-chat", 20, 5, first=60, user="bob"))
    step(sched, runner)
    assert "bob-chat" in running_ids(sched) and "alice-chat" not in running_ids(sched)
