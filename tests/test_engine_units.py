"""Small, exact tests of the pure engine parts (slots, queue, detokenizer, scheduler
bookkeeping), written where scripts/mutation found behaviour no other test would notice."""

from dataclasses import replace

import pytest

from localserve.engine.detokenize import IncrementalDetokenizer
from localserve.engine.finish import FinishReason
from localserve.engine.request import Request, RequestStatus, SamplingParams
from localserve.engine.scheduler import Scheduler
from localserve.engine.slots import SlotPool, common_prefix_len
from localserve.engine.waiting import FairQueue
from fakes import EOS, FakeVocab, PositionalRunner, ScriptedRunner, make, req, run


def request(rid, prompt=(1, 2, 3), max_tokens=50, user=None, ignore_eos=True, stop=()):
    return Request(list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos,
                                                stop=stop), request_id=rid, user=user)


def step(sched, runner):
    plan = sched.schedule()
    return plan, sched.update(plan, runner.decode(plan))


# ---- slots --------------------------------------------------------------------------------

def test_slot_transitions_refuse_illegal_moves():
    slot = SlotPool(64, 1).slots[0]
    with pytest.raises(RuntimeError, match="slot 0 is already idle"):
        slot.release()
    slot.assign(request("a"), 0, 1)
    with pytest.raises(RuntimeError, match="slot 0 is busy with a"):
        slot.assign(request("b"), 0, 2)


def test_pending_tokens_at_the_prompt_boundary():
    slot = SlotPool(64, 1).slots[0]
    req = request("a", prompt=(1, 2, 3))
    slot.assign(req, 0, 1)
    slot.computed([1, 2, 3])
    req.output_tokens = [7]
    assert slot.pending_tokens() == [7]


def test_pool_split_sizes_and_refusals():
    assert SlotPool(1000, 3).n_ctx_per_slot == 333 and isinstance(SlotPool(1000, 3).n_ctx_per_slot, int)
    assert SlotPool(40, 4, n_ctx_per_slot=40).n_ctx_per_slot == 40  # a shared pool may be tiny per slot
    with pytest.raises(ValueError, match="--parallel must be at least 1"):
        SlotPool(64, 0)
    with pytest.raises(ValueError, match="-c 40 split over 4 slots leaves 10 tokens per slot"):
        SlotPool(40, 4)


def test_common_prefix_len_counts_every_matching_token():
    assert common_prefix_len([1, 2, 3, 9], [1, 2, 3, 4]) == 3
    assert common_prefix_len([], [1]) == 0


def test_lru_idle_with_cache_skips_busy_empty_and_excluded_slots():
    pool = SlotPool(256, 4)
    busy, empty, old, new = pool.slots
    for slot in (busy, old, new):
        slot.computed([1])
    busy.assign(request("x"), 1, 1)
    old.last_used, new.last_used = 1.0, 2.0
    assert pool.lru_idle_with_cache() is old
    assert pool.lru_idle_with_cache(exclude=old) is new
    new.forget()
    assert pool.lru_idle_with_cache(exclude=old) is None


def test_best_idle_slot_leaves_one_token_to_compute_and_prefers_the_older_of_equals():
    pool = SlotPool(256, 2)
    prompt = list(range(1, 31))
    for slot, used in zip(pool.slots, (5.0, 3.0)):
        slot.computed(prompt)
        slot.last_used = used
    slot, keep = pool.best_idle_slot(prompt)
    assert keep == 29 and slot is pool.slots[1]


# ---- the fair queue ---------------------------------------------------------------------

def test_queue_take_remove_and_requeue():
    q = FairQueue()
    a1, a2, b1 = request("a1", user="a"), request("a2", user="a"), request("b1", user="b")
    for r in (a1, a2, b1):
        q.append(r)
    resumed = request("r", user="c")
    q.push_front(resumed)
    assert q.take(b1) is b1 and list(q) == [resumed, a1, a2]
    with pytest.raises(KeyError, match="b1"):
        q.take(b1)
    assert q.remove(resumed) is True and q.remove(resumed) is False
    assert q.remove(request("ghost", user="a")) is False
    lone = request("lone", user="z")
    q.requeue(lone)  # its user had nothing waiting
    assert list(q) == [a1, lone, a2] and q.users() == {"a", "z"}
    assert list(FairQueue()) == []


def test_requeue_keeps_the_users_other_requests_and_goes_right_behind_the_one_it_made_room_for():
    q = FairQueue()
    a1, a2, a3, b1 = (request(n, user=u) for n, u in (("a1", "a"), ("a2", "a"), ("a3", "a"),
                                                       ("b1", "b")))
    for r in (a1, a2, a3, b1):
        q.append(r)
    back = request("back", user="a")
    q.requeue(back, behind=a1)
    assert [r.request_id for r in q if r.user == "a"] == ["a1", "back", "a2", "a3"]
    q.requeue(request("again", user="a"))  # first of its user's, none of theirs lost
    assert [r.request_id for r in q if r.user == "a"] == ["again", "a1", "back", "a2", "a3"]


def test_tasks_wait_last_and_taking_one_leaves_the_turns_as_they_were():
    q = FairQueue()
    title, tags = request("title", user="c"), request("tags", user="c")
    title.background = tags.background = True
    for r in (title, tags):
        q.append(r)
    assert q.peek() is title and not q.has_foreground()
    c1, b1 = request("c1", user="c"), request("b1", user="b")
    for r in (c1, b1):
        q.append(r)
    assert q.take(title) is title and list(q) == [c1, b1, tags]  # carol keeps her turn
    q = FairQueue()
    q.push_front(request("resumed", user="d"))
    assert q.has_foreground()  # a preempted request is a chat waiting


def test_users_holding_fewer_slots_are_served_first():
    """Carol's ten chats came first in the rotation; alice and bob, holding nothing, start
    before carol's fourth (slot_shares.next_admissible passes what each holds)."""
    q = FairQueue()
    carol = [request(f"c{i}", user="carol") for i in range(3)]
    alice, bob = request("a", user="alice"), request("b", user="bob")
    for r in (*carol, alice, bob):
        q.append(r)
    assert list(q.in_turn({"carol": 3, "alice": 1})) == [bob, alice, *carol]
    assert list(q.in_turn({"carol": 3})) == [alice, bob, *carol]  # equals: rotation order
    assert list(q) == [carol[0], alice, bob, carol[1], carol[2]]


# ---- the detokenizer ------------------------------------------------------------------

def test_invalid_utf8_becomes_replacement_characters():
    detok = IncrementalDetokenizer()
    assert detok.feed(b"ok \xff") == "ok \ufffd"
    assert detok.feed(b"\xe2\x82") == ""  # an unfinished character is held...
    assert detok.flush() == "\ufffd"  # ...and flushed as one replacement character
    assert detok.flush() == ""


def test_stop_strings_cut_at_the_first_match_and_hold_only_real_prefixes():
    detok = IncrementalDetokenizer(stop=("xy",))
    assert detok.feed(b"hello") == "hello"  # nothing held back: no tail starts "xy"
    assert detok.feed(b" x") == " "
    assert detok.feed(b"y and xy") == ""
    assert detok.stopped is True and detok.feed(b"more") == "" and detok.flush() == ""
    twice = IncrementalDetokenizer(stop=("ab",))
    assert twice.feed(b"1ab2ab3") == "1"
    assert IncrementalDetokenizer(stop=("ab",)).stopped is False


# ---- scheduler bookkeeping ------------------------------------------------------------

def test_budget_limits_admission_chunks_and_a_budget_of_one_still_progresses():
    with pytest.raises(ValueError, match="--max-num-batched-tokens must be at least 1"):
        Scheduler(SlotPool(256, 2), FakeVocab(), 0)
    sched = Scheduler(SlotPool(256, 2), FakeVocab(), 8)
    sched.add(request("a", prompt=range(1, 7)))
    sched.add(request("b", prompt=range(1, 7)))
    plan = sched.schedule()
    assert [len(c.tokens) for c in plan.chunks] == [6, 2] and plan.num_tokens == 8
    one = Scheduler(SlotPool(256, 1), FakeVocab(), 1)
    one.add(request("a", prompt=(1, 2), max_tokens=2))
    runner = PositionalRunner(1000)
    plans = [step(one, runner)[0] for _ in range(3)]
    assert [c.tokens for p in plans for c in p.chunks] == [[1], [2], [plans[2].chunks[0].tokens[0]]]
    assert all(len(c.tokens) >= 1 for p in plans for c in p.chunks)


def test_statuses_counters_and_close_events_are_exact():
    sched = Scheduler(SlotPool(256, 2), FakeVocab(), 64)
    runner = ScriptedRunner({"a": [5, 6, 7], "b": [5, EOS]})
    a, b = request("a", max_tokens=3), request("b", ignore_eos=False)
    waiting = request("w")
    for r in (a, b):
        sched.add(r)
    assert a.status is RequestStatus.WAITING
    step(sched, runner)
    assert a.status is RequestStatus.RUNNING and a.first_token_time is not None
    first = a.first_token_time
    events = dict(step(sched, runner)[1])
    assert a.first_token_time == first
    assert events[b].finish_reason is FinishReason.STOP and events[b].token_ids == (EOS,)
    assert b.status is RequestStatus.FINISHED and b.finish_reason is FinishReason.STOP
    sched.add(waiting)
    _, ev = sched.abort("w", FinishReason.ERROR, "shutting down")
    assert (ev.text, ev.error, ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens) == (
        "", "shutting down", 3, 0, 0)
    assert ev.token_ids == ()  # an end without a token adds none to the generated count
    _, ev = sched.abort("a", FinishReason.ERROR, "decode failed")
    assert ev.error == "decode failed" and ev.completion_tokens == 2 and ev.prompt_tokens == 3
    assert ev.token_ids == ()
    for rid in ("x1", "x2"):
        sched.add(request(rid))
        sched.abort(rid)
    s = sched.stats
    assert (s.requests_finished, s.requests_failed, s.requests_aborted) == (1, 2, 2)
    assert s.steps == 2 and s.tokens_batched == 3 + 3 + 2 and s.max_decode_rows_in_step == 2
    assert s.prompt_tokens_computed == 6


def test_abort_finds_a_request_in_a_later_slot_and_a_missing_one_is_none():
    sched = Scheduler(SlotPool(256, 2), FakeVocab(), 64)
    runner = PositionalRunner(1000)
    sched.add(request("a"))
    sched.add(request("b"))
    step(sched, runner)
    sched.abort("a")
    req, ev = sched.abort("b", FinishReason.ERROR, "gone")
    assert req.request_id == "b" and ev.error == "gone"
    assert sched.abort("nobody") is None


def test_expiry_message_and_boundary():
    sched = Scheduler(SlotPool(64, 1), FakeVocab(), 64)
    sched.add(Request([1, 2], SamplingParams(), request_id="edge", arrival_time=100.0))
    assert sched.expire_waiting(30.0, now=130.0) == []  # exactly at the limit: not yet
    [(_, ev)] = sched.expire_waiting(30.0, now=130.5)
    assert ev.error == "no slot became free within 30 s; retry later"


def test_a_token_handling_bug_ends_that_request_with_an_error():
    class Exploding(FakeVocab):
        def piece(self, token):
            raise UnicodeError("bad piece")

    sched = Scheduler(SlotPool(256, 1), Exploding(), 64)
    sched.add(request("a"))
    [(req, ev)] = step(sched, PositionalRunner(1000))[1]
    assert ev.finish_reason is FinishReason.ERROR and "bad piece" in ev.error
    assert not sched.pool.slots[0].busy and sched.stats.requests_failed == 1


def test_aborted_mid_step_chunk_is_skipped_and_later_chunks_still_land():
    sched = Scheduler(SlotPool(256, 2), FakeVocab(), 64)
    runner = PositionalRunner(1000)
    sched.add(request("a"))
    sched.add(request("b"))
    plan = sched.schedule()
    out = runner.decode(plan)
    sched.abort("a")
    events = sched.update(plan, out)
    assert [r.request_id for r, _ in events] == ["b"]
    assert sched.pool.slots[1].n_cached == 3


def test_repeated_preemptions_are_counted_each_time():
    sched = Scheduler(SlotPool(80, 3, n_ctx_per_slot=80), FakeVocab(), 64)
    runner = PositionalRunner(80)
    reqs = [request(rid, prompt=range(1, 21), max_tokens=60) for rid in "abc"]
    for r in reqs:
        sched.add(r)
    while sched.has_work():
        step(sched, runner)
    assert sched.stats.preemptions == sum(r.preemptions for r in reqs) >= 2
    assert max(r.preemptions for r in reqs) >= 2


def test_shared_pool_admission_drops_idle_prefixes_only_as_needed():
    sched = Scheduler(SlotPool(100, 3, n_ctx_per_slot=100), FakeVocab(), 64)
    pool = sched.pool
    pool.slots[0].computed(list(range(100, 140)))
    pool.slots[1].computed(list(range(200, 230)))
    pool.slots[0].last_used, pool.slots[1].last_used = 1.0, 2.0
    sched.add(request("a", prompt=range(1, 31)))  # needs 31 cells: 30 free + one dropped slot
    plan = sched.schedule()
    assert plan.dropped == [0] and pool.slots[1].n_cached == 30  # the older prefix went
    assert [a.request.request_id for a in plan.admitted] == ["a"]


def test_shared_pool_decode_room_drops_an_idle_prefix_before_preempting():
    sched = Scheduler(SlotPool(44, 3, n_ctx_per_slot=44), FakeVocab(), 64)
    runner = PositionalRunner(44)
    sched.add(request("a", prompt=range(1, 21), max_tokens=30))
    sched.add(request("b", prompt=range(1, 21), max_tokens=30))
    step(sched, runner)
    idle = sched.pool.slots[2]
    idle.computed([9, 9])
    step(sched, runner)  # 40 + 2 used of 44: two decode rows need two cells
    assert sched.stats.preemptions == 0
    plan, _ = step(sched, runner)  # 42 + 2 = 44 used: the idle prefix goes, nobody is preempted
    assert idle.n_cached == 0 and sched.stats.preemptions == 0


def test_prefix_hits_accumulate_and_the_close_event_reports_the_requests_own_hit():
    sched = Scheduler(SlotPool(256, 1), FakeVocab(), 64)
    runner = PositionalRunner(1000)
    shared = list(range(1, 31))
    ends = []
    for rid, tail in (("a", [50]), ("b", [60]), ("c", [70])):
        sched.add(Request(shared + tail, SamplingParams(max_tokens=1), request_id=rid))
        while sched.has_work():
            ends += [ev for _, ev in step(sched, runner)[1] if ev.finished]
    assert sched.stats.prefix_cache_hits == 60
    assert [ev.cached_tokens for ev in ends] == [0, 30, 30]


def test_each_share_preemption_is_counted_and_the_request_waits_again():
    sched = Scheduler(SlotPool(256, 2), FakeVocab(), 64, slot_share=1)
    runner = PositionalRunner(1000)
    for i in range(3):
        sched.add(request(f"a{i}", user="alice", max_tokens=500))
    for n, bob in enumerate(("b0", "b1"), 1):
        step(sched, runner)
        assert [s.request.user for s in sched.pool.slots] == ["alice", "alice"]
        sched.add(request(bob, user="bob", max_tokens=1))
        step(sched, runner)  # alice gives one slot back; bob's one token ends at once
        assert sched.stats.share_preemptions == n
        assert all(r.status is RequestStatus.WAITING for r in sched.waiting)


def test_a_burst_of_events_from_the_engine_thread_wakes_the_event_loop_once_in_order():
    import asyncio
    import threading

    from localserve.engine.streams import Mailbox

    async def main():
        mailbox, got, wakeups = Mailbox.of_running_loop(), [], []
        original = mailbox._run
        mailbox._run = lambda: (wakeups.append(1), original())
        burst = threading.Thread(target=lambda: [mailbox.post(got.append, i) for i in range(100)])
        burst.start()
        burst.join()  # the event loop is blocked meanwhile: the whole burst is pending
        delivered = asyncio.Event()
        mailbox.post(lambda _: delivered.set(), None)  # runs after the burst, in order
        await asyncio.wait_for(delivered.wait(), timeout=10)
        return got, len(wakeups)

    got, wakeups = asyncio.run(main())
    assert got == list(range(100)) and wakeups == 1


def test_the_engine_threads_posts_wake_the_event_loop_only_when_it_lets_go():
    """hold_wake_ups (the engine thread's): posts are kept until wake_held(), which the loop
    calls before llama_decode and before waiting; another thread's post still wakes at once."""
    import asyncio
    import threading

    from localserve.engine.streams import Mailbox, hold_wake_ups, wake_held

    async def main():
        aloop = asyncio.get_running_loop()
        mailbox, got = Mailbox.of_running_loop(), []
        delivered, passed = asyncio.Event(), asyncio.Event()
        held, woken = threading.Event(), threading.Event()

        def engine():
            hold_wake_ups()
            mailbox.post(lambda token: (got.append(token), delivered.set()), "token")
            held.set()
            aloop.call_soon_threadsafe(passed.set)  # after any wake-up the post had sent
            woken.wait(10)
            wake_held()

        thread = threading.Thread(target=engine)
        thread.start()
        await asyncio.wait_for(passed.wait(), timeout=10)  # the event loop ran past the post
        before = list(got)
        woken.set()
        await asyncio.wait_for(delivered.wait(), timeout=10)
        thread.join()
        other = asyncio.Event()
        threading.Thread(target=lambda: mailbox.post(lambda _: other.set(), None)).start()
        await asyncio.wait_for(other.wait(), timeout=10)
        return before, got

    assert asyncio.run(main()) == ([], ["token"])


def test_a_request_whose_grammar_grew_costly_keeps_its_tokens_and_ends_with_its_reason():
    """The runner measures each constrained token's grammar cost; the scheduler ends the
    request it names in costly_grammars, after this step's token, and bills what it used."""
    sched = make(n_slots=2)
    runner = ScriptedRunner({"costly": [5] * 10, "free": [6] * 3 + [EOS]})
    costly, free = req("costly", 4), req("free", 4, first=50)
    sched.add(costly)
    sched.add(free)
    plan = sched.schedule()
    sched.update(plan, runner.decode(plan))
    plan = sched.schedule()
    slot = next(c.slot_id for c in plan.chunks if c.request is costly)
    events = sched.update(plan, replace(runner.decode(plan), costly_grammars=frozenset({slot})))
    ended = [e for r, e in events if r is costly and e.finished]
    assert ended and ended[0].finish_reason is FinishReason.GRAMMAR_COST
    assert "grammar" in ended[0].error and ended[0].completion_tokens == costly.num_output_tokens
    assert costly.output_tokens and free.finish_reason is None  # the other goes on
    out, _ = run(sched, runner)
    assert out["free"][1] is FinishReason.STOP


def test_text_held_back_for_a_possible_stop_string_is_flushed_at_end_of_generation():
    """'x' may start the stop string 'xy': held back until the next token, and the answer
    ends (EOS) there: the held text still reaches the client."""
    sched = make(n_slots=1)
    runner = ScriptedRunner({"a": [1, 23, EOS]})
    sched.add(req("a", 3, stop=("xy",)))
    out, _ = run(sched, runner)
    assert out["a"] == ("bx", FinishReason.STOP)


def test_prompt_progress_reports_what_each_chunk_computed_since_admission():
    """llama-server's return_progress, one report a computed chunk (two at the first chunk
    after the cached prefix: the cache, then the chunk), none for a decode row or a request
    that did not ask; the milliseconds count from admission, else from arrival."""
    import time

    from localserve.engine.plan import SeqChunk
    from localserve.engine.progress import prompt_progress

    r = Request(list(range(1, 101)), SamplingParams(progress=True), request_id="p")
    r.cached_tokens, r.arrival_time = 40, time.monotonic() - 5.0
    r.admitted_time = time.monotonic() - 2.0

    def reports(start, n):
        return [e.progress for _, e in prompt_progress(SeqChunk(0, r, [7] * n, start, False))]

    first, later = reports(40, 32), reports(72, 32)
    assert [p[:3] for p in first] == [(100, 40, 40), (100, 40, 72)]
    assert [p[:3] for p in later] == [(100, 40, 100)]  # capped at the prompt's end
    assert all(2000 <= p[3] < 4000 for p in first + later)
    assert reports(100, 1) == []  # a decode row: the prompt is computed
    assert [p[:3] for p in reports(99, 1)] == [(100, 40, 100)]
    r.admitted_time = None
    assert 5000 <= reports(72, 8)[0][3] < 7000
    assert prompt_progress(SeqChunk(0, Request([1, 2, 3], SamplingParams(), request_id="q"),
                                    [1, 2, 3], 0, True)) == []
