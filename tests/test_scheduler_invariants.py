"""One test per invariant written at Scheduler.schedule(), each built to fail when that
invariant is broken (see tests/mutation-equivalents.txt and scripts/mutation), plus the
engine loop's CacheFull -> preempt -> replan path driven with a fake runner (no llama.cpp)."""

import threading
import time

from localserve.engine.errors import CacheFull
from localserve.engine.loop import EngineLoop
from localserve.engine.finish import FinishReason
from localserve.engine.request import Request, RequestStatus, SamplingParams
from localserve.engine.scheduler import Scheduler
from localserve.engine.slots import MIN_PREFIX_REUSE, SlotPool, SlotState
from fakes import FakeVocab, PositionalRunner, run_all


def request(rid, prompt, max_tokens=50, **kw):
    return Request(list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   request_id=rid, **kw)


def step(sched, runner):
    plan = sched.schedule()
    events = sched.update(plan, runner.decode(plan))
    return plan, events


def test_invariant_1_every_decoding_slot_gets_a_row_in_every_step():
    sched = Scheduler(SlotPool(512, 2), FakeVocab(), max_num_batched_tokens=4)
    runner = PositionalRunner(10_000)
    sched.add(request("streaming", range(1, 4), max_tokens=100))
    while sched.pool.slots[0].state is not SlotState.DECODE:
        step(sched, runner)
    sched.add(request("long-prompt", range(10, 90)))  # 80 tokens: 20 steps of prefill at most
    prefill_steps = 0
    while sched.pool.slots[1].state is not SlotState.DECODE:
        plan, _ = step(sched, runner)
        rows = {c.request.request_id: c for c in plan.chunks}
        assert "streaming" in rows and len(rows["streaming"].tokens) == 1 and rows["streaming"].sample
        prefill_steps += "long-prompt" in rows
    assert prefill_steps >= 20  # the prompt really was chunked around the stream's rows


def test_invariant_2_a_preempted_request_is_the_next_admitted():
    sched = Scheduler(SlotPool(80, 2, n_ctx_per_slot=80), FakeVocab(), 64)
    runner = PositionalRunner(80)
    for rid, user in (("a", "ann"), ("b", "bob"), ("c", "cat"), ("d", "dan")):
        sched.add(request(rid, range(1, 21), max_tokens=60, user=user))
    while sched.stats.preemptions == 0:
        step(sched, runner)
    preempted = next(r for r in sched.waiting if r.preemptions)
    admitted = []
    while not admitted:
        plan, _ = step(sched, runner)
        admitted = [a.request for a in plan.admitted]
    assert admitted[0] is preempted  # before c and d, who waited longer and are other users


def test_invariant_3_a_short_shared_prefix_does_not_take_a_recently_used_slot():
    pool = SlotPool(512, 2)
    prompt = list(range(1, 60))
    pool.slots[0].computed(prompt[:MIN_PREFIX_REUSE - 1] + [999])
    pool.slots[0].last_used = 10.0  # used recently; slot 1 is the least recently used
    pool.slots[1].computed([500, 501])
    slot, keep = pool.best_idle_slot(prompt)
    assert slot is pool.slots[1] and keep == 0
    pool.slots[0].forget()
    pool.slots[0].computed(prompt[:MIN_PREFIX_REUSE] + [999])
    slot, keep = pool.best_idle_slot(prompt)
    assert slot is pool.slots[0] and keep == MIN_PREFIX_REUSE


def until_first_preemption(request_ids: str):
    """A shared pool of 80 cells, one 20-token request per id: run until one is preempted."""
    sched = Scheduler(SlotPool(80, 2, n_ctx_per_slot=80), FakeVocab(), 64)
    runner = PositionalRunner(80)
    for rid in request_ids:
        sched.add(request(rid, range(1, 21), max_tokens=60))
    while sched.stats.preemptions == 0:
        step(sched, runner)
    return sched, runner


def test_invariant_4_only_requests_that_never_had_a_slot_expire():
    sched, _ = until_first_preemption("abc")
    preempted = next(r for r in sched.waiting if r.preemptions)
    never_ran = next(r for r in sched.waiting if not r.preemptions)
    expired = sched.expire_waiting(0.0, now=never_ran.arrival_time + 1000)
    assert [(r.request_id, e.finish_reason) for r, e in expired] == [
        (never_ran.request_id, FinishReason.TIMEOUT)]
    assert list(sched.waiting) == [preempted]  # it holds a client mid-answer: never expired
    assert sched.stats.requests_failed == 1 and sched.stats.requests_aborted == 0


def test_invariant_5_prefix_hits_count_first_admissions_only():
    sched, runner = until_first_preemption("ab")
    queries, hits = sched.stats.prefix_cache_queries, sched.stats.prefix_cache_hits
    while sched.has_work():
        step(sched, runner)
    assert (sched.stats.prefix_cache_queries, sched.stats.prefix_cache_hits) == (queries, hits)
    assert queries == 40


class CacheFullOnce(PositionalRunner):
    """Refuses the first batch that carries two or more sequences, as llama_decode does when
    a fragmented pool has no room for it."""

    def __init__(self):
        super().__init__(10_000)
        self.refused = 0

    def decode(self, plan):
        if not self.refused and len({c.slot_id for c in plan.chunks}) >= 2:
            self.refused += 1
            raise CacheFull("no free cache cells")
        return super().decode(plan)


def test_loop_preempts_and_replans_when_the_runner_finds_the_cache_full():
    runner = CacheFullOnce()
    sched = Scheduler(SlotPool(512, 2, n_ctx_per_slot=512), FakeVocab(), 64)
    loop = EngineLoop(sched, runner)
    events = {}
    requests = [request(rid, range(1, 11), max_tokens=5) for rid in "ab"]
    for r in requests:
        r.emit = lambda e, rid=r.request_id: events.setdefault(rid, []).append(e)
        sched.add(r)
    for _ in range(100):
        if not sched.has_work():
            break
        loop.step()
    assert runner.refused == 1 and sched.stats.preemptions == 1
    assert {rid: (sum(len(e.token_ids) for e in evs), evs[-1].finish_reason)
            for rid, evs in events.items()} == {"a": (5, "length"), "b": (5, "length")}
    assert sched.stats.requests_failed == 0


def test_invariant_7_big_prefill_steps_only_while_nothing_decodes():
    sched = Scheduler(SlotPool(2048, 2), FakeVocab(), max_num_batched_tokens=8, prefill_budget=64)
    runner = PositionalRunner(10_000)
    sched.add(request("first", range(1, 101), max_tokens=50))
    plan, _ = step(sched, runner)
    assert plan.num_tokens == 64  # nobody decodes: a full prefill step
    while sched.pool.slots[0].state is not SlotState.DECODE:
        step(sched, runner)
    sched.add(request("second", range(200, 300)))
    for _ in range(5):
        plan, _ = step(sched, runner)
        assert plan.num_tokens <= 8  # a stream decodes: the smoothness budget again


class FatalInAnotherThread:
    """A runner whose llama_decode never returns because a helper thread of llama.cpp (as the
    RPC backend's) hit a fatal error: what runner/aborts.py reports through loop.fatal."""

    def __init__(self):
        self.loop = None

    def forget_interrupt(self):
        pass  # nothing ever asks it to stop

    def decode(self, plan):
        threading.Thread(target=self.loop.fatal, args=("remote worker gone",)).start()
        threading.Event().wait()


def test_a_fatal_llama_error_during_decode_fails_every_request_and_the_loop():
    runner = FatalInAnotherThread()
    sched = Scheduler(SlotPool(512, 2), FakeVocab(), 64)
    loop = runner.loop = EngineLoop(sched, runner)
    ended = threading.Event()
    events = []
    r = request("stuck", range(1, 11))
    r.emit = lambda e: (events.append(e), e.finished and ended.set())
    loop.start()
    loop.submit(r)
    assert ended.wait(10)
    assert events[-1].finish_reason is FinishReason.ERROR and "remote worker gone" in events[-1].error
    assert loop.failure and "remote worker gone" in loop.failure and loop.decoding


def test_n_choices_prefill_the_prompt_once_and_each_matches_a_solo_run():
    """n > 1: siblings wait for the first choice's prompt, copy it from its slot, compute only
    the last prompt token themselves, and produce exactly what a lone request would."""
    prompt = list(range(1, 41))
    solo = request("alone", prompt, max_tokens=8)
    run_all(Scheduler(SlotPool(512, 4), FakeVocab(), 16), PositionalRunner(10_000), [solo])
    sched = Scheduler(SlotPool(512, 4), FakeVocab(), 16)
    runner = PositionalRunner(10_000)
    first = request("c0", prompt, max_tokens=8)
    siblings = [request(f"c{i}", prompt, max_tokens=8, prefix_of=first) for i in (1, 2)]
    for req in (first, *siblings):
        sched.add(req)
    assert [r.status for r in siblings] == [RequestStatus.HELD] * 2
    copies = []
    while sched.has_work():
        plan, _ = step(sched, runner)
        if not first.output_tokens:
            assert [a.request for a in plan.admitted] in ([], [first])  # siblings wait
            assert {r.status for r in siblings} == {RequestStatus.HELD}
        copies += [a.copy_from for a in plan.admitted if a.request is not first]
    assert copies == [0, 0]  # both copied the first choice's slot
    assert sched.stats.prompt_tokens_computed == len(prompt) + 2  # + the last token, per sibling
    assert [r.cached_tokens for r in siblings] == [len(prompt) - 1] * 2
    for req in (first, *siblings):
        assert req.output_tokens == solo.output_tokens and len(req.output_tokens) == 8


def test_n_choices_bill_the_prompt_once_on_the_first_choice():
    """What the ledger, quotas and metrics receive: the final events' counts. n = 3 over one
    prompt is billed that prompt once (and its cached tokens once), each choice its own output."""
    prompt = list(range(1, 41))
    sched = Scheduler(SlotPool(512, 4), FakeVocab(), 16)
    runner = PositionalRunner(10_000)
    first = request("c0", prompt, max_tokens=4)
    choices = [first] + [request(f"c{i}", prompt, max_tokens=4, prefix_of=first) for i in (1, 2)]
    for req in choices:
        sched.add(req)
    final = {}
    while sched.has_work():
        _, events = step(sched, runner)
        final.update({req.request_id: ev for req, ev in events if ev.finish_reason})
    assert [final[f"c{i}"].prompt_tokens for i in range(3)] == [len(prompt), 0, 0]
    assert [final[f"c{i}"].cached_tokens for i in range(3)] == [0, 0, 0]
    assert [final[f"c{i}"].completion_tokens for i in range(3)] == [4, 4, 4]


def test_an_aborted_sibling_and_first_choice_still_bill_the_prompt_once():
    prompt = list(range(1, 41))
    sched = Scheduler(SlotPool(512, 4), FakeVocab(), 16)
    first = request("c0", prompt, max_tokens=4)
    sibling = request("c1", prompt, max_tokens=4, prefix_of=first)
    sched.add(first)
    sched.add(sibling)
    ends = [sched.abort("c1")[1], sched.abort("c0")[1]]
    assert [e.prompt_tokens for e in ends] == [0, len(prompt)]
    assert [e.finish_reason for e in ends] == [FinishReason.ABORT] * 2


def test_finish_reasons_map_to_one_status_each():
    """The one table answers and ledger rows read (engine/finish.py)."""
    assert {str(r): r.status for r in FinishReason} == {
        "stop": 200, "length": 200, "tool_calls": 200, "abort": 499, "timeout": 503, "error": 500,
        "grammar_cost": 400}
    assert [r for r in FinishReason if r.completed] == [
        FinishReason.STOP, FinishReason.LENGTH, FinishReason.TOOL_CALLS]


def test_a_sibling_copies_the_slot_holding_its_whole_prompt_not_one_sharing_its_start():
    """A decoy idle slot shares the prompt's first tokens only: the siblings must copy the
    first choice's slot, which holds all of it."""
    prompt = list(range(1, 41))
    sched = Scheduler(SlotPool(512, 4), FakeVocab(), 16)
    runner = PositionalRunner(10_000)
    run_all(sched, runner, [request("decoy", prompt[:8] + [99] * 32, max_tokens=1)])
    solo = request("alone", prompt, max_tokens=8)
    run_all(Scheduler(SlotPool(512, 4), FakeVocab(), 16), PositionalRunner(10_000), [solo])
    first = request("c0", prompt, max_tokens=8)
    siblings = [request(f"c{i}", prompt, max_tokens=8, prefix_of=first) for i in (1, 2)]
    for req in (first, *siblings):
        sched.add(req)
    copies, first_slot = [], None
    while sched.has_work():
        plan, _ = step(sched, runner)
        first_slot = next((a.slot_id for a in plan.admitted if a.request is first), first_slot)
        copies += [a.copy_from for a in plan.admitted if a.request is not first]
    assert copies == [first_slot] * 2
    assert all(r.output_tokens == solo.output_tokens for r in siblings)


class RecordingRunner(PositionalRunner):
    def __init__(self):
        super().__init__(10_000)
        self.batches: list[set[str]] = []

    def decode(self, plan):
        self.batches.append({c.request.request_id for c in plan.chunks})
        return super().decode(plan)


def test_requests_accepted_together_are_prefilled_in_one_step_not_the_first_alone():
    """Woken from idle, the loop waits while the HTTP side still has accepted requests on their
    way (their leases), so the first prefill step takes them all, as llama-server's does."""
    runner, arriving = RecordingRunner(), [3]
    sched = Scheduler(SlotPool(2048, 4), FakeVocab(), 8, prefill_budget=64)
    loop = EngineLoop(sched, runner, arriving=lambda: arriving[0])
    loop.arrival_window_s = 60.0  # the count decides here, not the time
    ended = threading.Semaphore(0)
    loop.start()
    try:
        for rid in "abc":
            r = request(rid, range(1, 11), max_tokens=3)
            r.emit = lambda e: e.finished and ended.release()
            loop.submit(r)
            arriving[0] -= 1  # its lease ends once it is submitted
            time.sleep(0.05)  # the next one is still being tokenized
        assert all(ended.acquire(timeout=30) for _ in "abc")
        assert runner.batches[0] == {"a", "b", "c"}
    finally:
        loop.stop()


def test_a_request_whose_companions_never_come_waits_only_the_arrival_window():
    runner = RecordingRunner()
    loop = EngineLoop(Scheduler(SlotPool(2048, 4), FakeVocab(), 8), runner, arriving=lambda: 1)
    ended = threading.Event()
    r = request("alone", range(1, 11), max_tokens=3)
    r.emit = lambda e: e.finished and ended.set()
    loop.start()
    try:
        loop.submit(r)
        assert ended.wait(30) and runner.batches[0] == {"alone"}
    finally:
        loop.stop()


def prefilling(sched, ids) -> set:
    return {s.request.request_id for s in sched.running
            if s.state is SlotState.PREFILL and s.request.request_id in ids}


def test_invariant_10_long_prompts_prefill_at_most_their_cap_and_a_follow_up_passes_them():
    sched = Scheduler(SlotPool(4096, 4, n_ctx_per_slot=1024), FakeVocab(), 16, max_long_prompts=1)
    runner = PositionalRunner(10_000)
    first_turn = request("turn-1", range(1, 101), max_tokens=3)
    run_all(sched, runner, [first_turn])
    for n, rid in enumerate("abc"):  # three colleagues' documents, 7 steps of prompt each
        sched.add(request(rid, range(1000 * n + 200, 1000 * n + 300), max_tokens=40))
    follow_up = first_turn.all_tokens + list(range(500, 505))  # the conversation's next turn
    sched.add(request("turn-2", follow_up, max_tokens=80))
    order = []
    while "c" not in order:
        plan, _ = step(sched, runner)
        order += [a.request.request_id for a in plan.admitted]
        assert len(prefilling(sched, set("abc"))) <= 1
    assert order == ["a", "turn-2", "b", "c"]  # the follow-up went past the waiting documents
    running = {s.request.request_id for s in sched.running}
    assert plan.admitted[0].kept_tokens == 0 and {"a", "b"} <= running
    # each document started when the one before had computed its prompt, not its answer


def test_invariant_10_a_new_document_waits_for_prompts_computed_not_for_whole_answers():
    """Alice's three documents with long answers hold every long-prompt place while their
    prompts are computed; bob's document, arriving then, starts as soon as one of them
    answers, not when it has answered."""
    sched = Scheduler(SlotPool(8192, 6, n_ctx_per_slot=2048), FakeVocab(), 64, max_long_prompts=3)
    runner = PositionalRunner(10_000)
    alices = {f"alice{n}" for n in range(3)}
    for n in range(3):
        sched.add(request(f"alice{n}", range(1000 * n + 200, 1000 * n + 400), max_tokens=400,
                          user="alice"))
    for _ in range(3):
        step(sched, runner)
    sched.add(request("bob", range(5000, 5200), max_tokens=40, user="bob"))
    for _ in range(30):
        plan, _ = step(sched, runner)
        if any(a.request.request_id == "bob" for a in plan.admitted):
            break
    running = {s.request.request_id: s for s in sched.running}
    assert "bob" in running and all(running[a].request.num_output_tokens < 400
                                    for a in alices & running.keys())


def test_a_key_keeps_all_but_one_long_prompt_place_while_another_keys_waits():
    from localserve.engine.long_prompts import LongPromptPlaces

    def slot(user):
        s = SlotPool(4096, 4).slots[0]
        s.assign(request(user, range(200), user=user), 0, 1)
        s.request.long_prompt = True
        return s

    alice_two, bobs = [slot("alice"), slot("alice")], [request("b", range(300), user="bob")]
    assert not LongPromptPlaces(3, 64, alice_two, bobs).free_for("alice")
    assert LongPromptPlaces(3, 64, alice_two, bobs).free_for("bob")
    assert LongPromptPlaces(3, 64, alice_two, []).free_for("alice")  # nobody else waits
    assert not LongPromptPlaces(2, 64, alice_two, []).free_for("bob")  # every place taken


def test_invariant_11_a_request_that_fits_passes_one_that_cannot_fit_yet_until_it_has_aged():
    """Alice's long answer holds most of the pool; bob's document cannot fit until it ends.
    Carol's short chat, behind bob's, fits: it starts now (it waited 35 s behind a document
    that waited for an answer). Passed MAX_TIMES_PASSED times, bob's document holds the queue."""
    from localserve.engine.scheduler import MAX_TIMES_PASSED

    def started(times_passed):
        sched = Scheduler(SlotPool(200, 3, n_ctx_per_slot=200), FakeVocab(), 64)
        runner = PositionalRunner(10_000)
        sched.add(request("alice", range(1, 121), max_tokens=70, user="alice"))
        for _ in range(3):
            step(sched, runner)
        bob = request("bob", range(300, 400), max_tokens=10, user="bob")
        bob.times_passed = times_passed
        sched.add(bob)
        sched.add(request("carol", range(500, 510), max_tokens=5, user="carol"))
        plan, _ = step(sched, runner)
        return [a.request.request_id for a in plan.admitted], bob.times_passed

    assert started(0) == (["carol"], 1)
    assert started(MAX_TIMES_PASSED) == ([], MAX_TIMES_PASSED)


def test_invariant_11_a_new_chat_starts_beside_a_colleagues_long_prompt():
    """Alice's 1,000-token prompt computes 64 tokens a step; bob's chat, arriving meanwhile,
    starts in the next step (it waited for her whole prompt, 58 s on a busy machine)."""
    sched = Scheduler(SlotPool(4096, 4), FakeVocab(), 64)
    runner = PositionalRunner(10_000)
    sched.add(request("alice", range(1, 1001), max_tokens=5, user="alice"))
    step(sched, runner)
    sched.add(request("bob", range(2000, 2030), max_tokens=5, user="bob"))
    plan, _ = step(sched, runner)
    assert [a.request.request_id for a in plan.admitted] == ["bob"]
    assert {c.request.request_id: len(c.tokens) for c in plan.chunks} == {"alice": 32, "bob": 30}
    plan, _ = step(sched, runner)  # nobody waits: her prompt has the step again
    assert {c.request.request_id: len(c.tokens) for c in plan.chunks} == {"alice": 63, "bob": 1}


def test_invariant_11_a_chat_starting_beside_a_long_prompt_gets_a_step_of_its_own_size():
    """Alice's 4,000-token prompt, alone, computes in prefill steps of 1,024 tokens (3-4 s each
    on 2 cores). Bob's 100-token chat starts in a step that carries 50 of her tokens, not half
    of the 1,024: his first token comes about as soon as alone (it waited 4.7 s)."""
    sched = Scheduler(SlotPool(8192, 6, n_ctx_per_slot=8192), FakeVocab(), 256, prefill_budget=1024)
    runner = PositionalRunner(10_000)
    sched.add(request("alice", range(1, 4001), max_tokens=5, user="alice"))
    plan, _ = step(sched, runner)
    assert plan.num_tokens == 1024
    sched.add(request("bob", range(5000, 5100), max_tokens=5, user="bob"))
    plan, _ = step(sched, runner)
    assert {c.request.request_id: len(c.tokens) for c in plan.chunks} == {"alice": 50, "bob": 100}


def test_invariant_12_a_step_of_prompt_chunks_may_be_stopped_for_a_chat_never_two_in_a_row():
    """A step that samples no row may be stopped when a chat arrives whose prompt fits a step
    (the runner's interrupt; a long one gains nothing from it); one that samples may not, nor
    the step after a stopped one (the long prompt always gets on), nor one with no slot free
    (the chat could not start)."""
    sched = Scheduler(SlotPool(8192, 2, n_ctx_per_slot=8192), FakeVocab(), 256, prefill_budget=1024)
    runner = PositionalRunner(10_000)
    sched.add(request("alice", range(1, 4001), max_tokens=5, user="alice"))
    plan = sched.schedule()
    assert plan.stop_rule.below == 256
    sched.interrupted(plan, [])
    plan = sched.schedule()
    assert not plan.stop_rule.below
    sched.update(plan, runner.decode(plan))
    plan, _ = step(sched, runner)
    assert plan.stop_rule.below == 256
    sched.add(request("bob", range(5000, 5030), max_tokens=5, user="bob"))
    plan, _ = step(sched, runner)  # bob's prompt is sampled: no stopping
    assert not plan.stop_rule.below
    plan = sched.schedule()  # both slots taken: a chat arriving could not start
    assert not plan.stop_rule.below


def test_invariant_11_no_budget_is_kept_for_a_chat_that_cannot_start_yet():
    """Carol's chat waits with a slot free but no room in the pool for her prompt: alice's
    prompt keeps the whole step (half of it went unused every step before: colleagues'
    documents ran at 0.96x llama-server)."""
    sched = Scheduler(SlotPool(1200, 4, n_ctx_per_slot=1200), FakeVocab(), 64)
    runner = PositionalRunner(1200)
    sched.add(request("alice", range(1, 1001), max_tokens=5, user="alice"))
    for _ in range(13):  # 832 of her 1,000 tokens in the pool: 368 cells free
        step(sched, runner)
    sched.add(request("carol", range(2000, 2400), max_tokens=5, user="carol"))
    plan, _ = step(sched, runner)
    assert not plan.admitted and sched.pool.free < 400
    assert {c.request.request_id: len(c.tokens) for c in plan.chunks} == {"alice": 64}


def test_invariant_11_a_chat_starts_in_a_step_without_a_colleagues_image():
    """Carol's image is next in her prompt when alice's chat arrives: it waits a step. An image
    costs far more than its rows (its own llama_decode calls and the encoder): beside ten
    images alice's first token took 4.9x alone, 2.2x once they waited."""
    from localserve.engine.image_rows import image_id

    sched = Scheduler(SlotPool(4096, 4), FakeVocab(), 256)
    runner = PositionalRunner(10_000)
    picture = [image_id(7, row, False) for row in range(16)]
    sched.add(request("carol", [*range(1, 257), *picture, 900, 901], max_tokens=5, user="carol"))
    plan, _ = step(sched, runner)
    assert plan.num_tokens == 256  # her text, up to the image
    her_own = [image_id(8, row, False) for row in range(16)]  # the chat's own image goes in
    sched.add(request("alice", [*range(2000, 2010), *her_own, 2010], max_tokens=5, user="alice"))
    plan, _ = step(sched, runner)
    assert {c.request.request_id: len(c.tokens) for c in plan.chunks} == {"alice": 27}
    plan, _ = step(sched, runner)
    assert {c.request.request_id: len(c.tokens) for c in plan.chunks} == {"alice": 1, "carol": 18}


def test_invariant_6_a_key_holding_nothing_starts_before_the_next_of_a_keys_burst():
    """Carol sent four chats at once and holds slots; alice's chat, arriving after them, is
    admitted before carol's next (the rotation alone had carol first: she was in it first)."""
    sched = Scheduler(SlotPool(4096, 6), FakeVocab(), 64, slot_share=5)
    runner = PositionalRunner(10_000)
    for i in range(4):
        sched.add(request(f"carol{i}", range(100 * i + 1, 100 * i + 61), user="carol"))
    plan, _ = step(sched, runner)
    assert len(sched.waiting) > 1
    sched.add(request("alice", range(2000, 2020), user="alice"))
    plan, _ = step(sched, runner)
    assert plan.admitted[0].request.request_id == "alice"


def test_invariant_12_a_step_for_one_keys_burst_may_be_stopped_by_another_keys_chat():
    """Carol sent five chats at once: a step giving first tokens to hers only, with more of
    hers waiting, may be stopped by alice's chat (beside ten images she waited for carol's first
    image step), not by carol's own next; alice then starts, carol's tokens beside her 32 at
    most, and that step is not stopped again."""
    sched = Scheduler(SlotPool(4096, 6), FakeVocab(), 256, slot_share=5)
    for i in range(5):
        sched.add(request(f"carol{i}", range(100 * i + 1, 100 * i + 41), user="carol"))
    plan = sched.schedule()
    alice = request("alice", range(2000, 2030), max_tokens=5, user="alice")
    assert plan.stop_rule.stops(alice)
    assert not plan.stop_rule.stops(request("carol5", range(3000, 3030), user="carol"))
    sched.interrupted(plan, [])
    sched.add(alice)
    plan = sched.schedule()
    assert plan.admitted[0].request.request_id == "alice"
    assert sum(len(c.tokens) for c in plan.chunks if c.request.user == "carol") <= 32
    assert not plan.stop_rule.stops(request("bob", range(4000, 4030), user="bob"))


def test_invariant_12_a_keys_step_with_nothing_more_of_it_waiting_or_shared_is_not_stopped():
    def first_step(*users):
        sched = Scheduler(SlotPool(4096, 6), FakeVocab(), 256, slot_share=5)
        for i, user in enumerate(users):
            sched.add(request(f"{user}{i}", range(100 * i + 1, 100 * i + 11), user=user))
        return sched.schedule()

    dave = request("dave", range(2000, 2030), user="dave")
    assert not first_step("carol").stop_rule.stops(dave)  # her one chat
    assert not first_step("carol", "bob").stop_rule.stops(dave)  # bob's first token is in it too
    assert first_step("carol", "carol", "carol", "carol", "carol", "carol", "carol").stop_rule.stops(dave)


def test_a_tasks_first_token_is_nobodys_first_token():
    """A frontend's title task gives no colleague a first token: its step may carry drafts
    and be stopped by a chat (invariants 9 and 13)."""
    sched = Scheduler(SlotPool(4096, 6), FakeVocab(), 256)
    sched.add(request("title", range(1, 11), user="carol", background=True))
    plan = sched.schedule()
    assert plan.chunks[0].sample and plan.first_token_keys == set()
    assert not plan.gives_first_token and plan.stop_rule.tasks_only
    sched = Scheduler(SlotPool(4096, 6), FakeVocab(), 256)
    sched.add(request("chat", range(1, 11), user="carol"))
    assert sched.schedule().first_token_keys == {"carol"}


def test_invariant_6_a_key_at_its_share_keeps_its_slots_while_a_colleague_waits():
    """Alice holds two slots, her share; bob waits for one: nobody is preempted (only a key
    above its share gives a slot back)."""
    sched = Scheduler(SlotPool(4096, 2), FakeVocab(), 64, slot_share=2)
    runner = PositionalRunner(10_000)
    for i in range(2):
        sched.add(request(f"alice{i}", range(100 * i + 1, 100 * i + 11), user="alice"))
    step(sched, runner)
    sched.add(request("bob", range(2000, 2010), user="bob"))
    step(sched, runner)
    assert sched.stats.share_preemptions == 0
    assert {s.request.request_id for s in sched.running} == {"alice0", "alice1"}
