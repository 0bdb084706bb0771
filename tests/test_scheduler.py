"""Unit tests of the pure-Python scheduler with a scripted fake runner (no model)."""

import pytest

from fakes import EOS, ScriptedRunner, make, req, run, step
from localserve.engine.request import Request, SamplingParams
from localserve.engine.slots import SlotState

def test_chunked_prefill_respects_budget_and_positions():
    sched = make(n_slots=1, budget=4)
    runner = ScriptedRunner({"a": [3, 4, EOS]})
    sched.add(req("a", 10))
    out, _ = run(sched, runner)
    assert out["a"] == ("de", "stop")
    assert [b[0][1] for b in runner.batches[:3]] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    assert [b[0][2] for b in runner.batches] == [0, 4, 8, 10, 11]
    assert all(sum(len(t) for _, t, _ in b) <= 4 for b in runner.batches)


def test_decode_rows_come_before_prefill_and_share_a_step():
    sched = make(n_slots=2, budget=4)
    runner = ScriptedRunner({"a": [5] * 20 + [EOS], "b": [6, EOS]})
    sched.add(req("a", 2))
    run_steps = 3
    for _ in range(run_steps):
        plan = sched.schedule()
        sched.update(plan, runner.decode(plan))
    sched.add(req("b", 9))  # arrives while "a" streams
    plan = sched.schedule()
    assert plan.chunks[0].slot_id == 0 and len(plan.chunks[0].tokens) == 1  # a's decode token first
    assert plan.chunks[1].tokens == [1, 2, 3]  # b's first prompt chunk fills the rest of the budget
    sched.update(plan, runner.decode(plan))
    out, _ = run(sched, runner)
    assert sched.stats.max_decode_rows_in_step == 2
    assert out["b"] == ("g", "stop")


def test_late_short_request_finishes_before_earlier_long_one():
    sched = make(n_slots=2, budget=16)
    runner = ScriptedRunner({"long": [7] * 50 + [EOS], "short": [8, EOS]})
    sched.add(req("long", 3))
    finished = []
    for step in range(200):
        if step == 2:
            sched.add(req("short", 3))
        if not sched.has_work():
            break
        plan = sched.schedule()
        for r, ev in sched.update(plan, runner.decode(plan)):
            if ev.finished:
                finished.append(r.request_id)
    assert finished == ["short", "long"]


def test_waiting_request_admitted_the_step_after_a_slot_frees():
    sched = make(n_slots=1, budget=16)
    runner = ScriptedRunner({"a": [4, EOS], "b": [5, EOS]})
    sched.add(req("a", 2))
    sched.add(req("b", 2))
    plan = sched.schedule()
    assert [c.request.request_id for c in plan.chunks] == ["a"]
    sched.update(plan, runner.decode(plan))
    plan = sched.schedule()
    sched.update(plan, runner.decode(plan))  # a samples EOS and frees its slot
    plan = sched.schedule()
    assert [c.request.request_id for c in plan.chunks] == ["b"]


def test_max_num_seqs_caps_running():
    sched = make(n_slots=3, budget=64, max_num_seqs=2)
    for rid in "abc":
        sched.add(req(rid, 2))
    plan = sched.schedule()
    assert len(plan.admitted) == 2 and len(sched.waiting) == 1


def test_max_tokens_gives_length():
    sched = make()
    sched.add(req("a", 2, max_tokens=3))
    out, _ = run(sched, ScriptedRunner({"a": [1, 2, 3, 4, 5]}))
    assert out["a"] == ("bcd", "length")


def test_slot_context_limit_gives_length():
    sched = make(n_slots=1, ctx=16, budget=64)
    sched.add(req("a", 10))
    out, _ = run(sched, ScriptedRunner({"a": [1] * 50}))
    text, reason = out["a"]
    assert reason == "length"
    assert 10 + len(text) == 16 + 1  # 16 cached positions, plus the last token sampled


def test_stop_string_across_tokens_is_cut_and_not_leaked():
    sched = make()
    # tokens 2,3,4,5 render "cdef"; stop on "de" which spans two tokens
    sched.add(req("a", 2, stop=("de",)))
    out, _ = run(sched, ScriptedRunner({"a": [2, 3, 4, 5, 6, EOS]}))
    assert out["a"] == ("c", "stop")


def test_prompt_that_cannot_fit_is_refused():
    sched = make(n_slots=2, ctx=16)
    with pytest.raises(ValueError, match="16"):
        sched.add(req("a", 16))


def test_abort_frees_slot_for_next_step():
    sched = make(n_slots=1, budget=16)
    runner = ScriptedRunner({"a": [5] * 50, "b": [6, EOS]})
    sched.add(req("a", 2))
    sched.add(req("b", 2))
    for _ in range(3):
        plan = sched.schedule()
        sched.update(plan, runner.decode(plan))
    req_a, event = sched.abort("a")
    assert event.finish_reason == "abort" and sched.pool.slots[0].state is SlotState.IDLE
    plan = sched.schedule()
    assert [c.request.request_id for c in plan.chunks] == ["b"]


def test_abort_while_step_in_flight_drops_its_result():
    sched = make(n_slots=1)
    runner = ScriptedRunner({"a": [5] * 50})
    sched.add(req("a", 2))
    plan = sched.schedule()
    out = runner.decode(plan)
    sched.abort("a")
    assert sched.update(plan, out) == []


def test_prefix_reuse_keeps_shared_prompt_in_cache():
    sched = make(n_slots=2, budget=64)
    runner = ScriptedRunner({"a": [9, EOS], "b": [9, EOS]})
    sched.add(req("a", 20))
    run(sched, runner)
    sched.add(req("b", 25))  # same first 20 tokens
    plan = sched.schedule()
    assert plan.admitted[0].kept_tokens == 20 and plan.chunks[0].tokens == list(range(21, 26))
    assert plan.chunks[0].start_pos == 20


def test_failed_decode_ends_only_that_batch():
    sched = make(n_slots=2, budget=64)
    sched.add(req("a", 2))
    plan = sched.schedule()
    events = sched.fail(plan, "boom")
    assert [(r.request_id, e.finish_reason, e.error) for r, e in events] == [("a", "error", "boom")]
    sched.add(req("b", 2))
    out, _ = run(sched, ScriptedRunner({"b": [3, EOS]}))
    assert out["b"] == ("d", "stop")


def test_end_events_name_their_stop_type_and_the_token_that_ended_them():
    """A stop string's last token is the answer's last token id (llama-server's `tokens`);
    an abort has stop type none, and the text held back as a stop string's possible start
    is not sent with it (the answer did not end there)."""
    sched = make(n_slots=2, budget=16)
    runner = ScriptedRunner({"worded": [3, 4, 5, EOS], "aborted": [6] * 50})
    sched.add(req("worded", 3, stop=("de",)))
    sched.add(req("aborted", 3, stop=("gh",)))  # every "g" is held back
    ends = {}
    for _ in range(4):
        for request, event in sched.update(plan := sched.schedule(), runner.decode(plan)):
            if event.finished:
                ends[request.request_id] = event
    _, aborted = sched.abort("aborted")
    assert (ends["worded"].stop_type, ends["worded"].token_ids) == ("word", (4,))
    assert (aborted.stop_type, aborted.token_ids, aborted.text) == ("none", (), "")


def test_a_first_choice_that_ends_before_its_first_token_lets_its_siblings_compute_the_prompt():
    from localserve.engine.request import Request, RequestStatus, SamplingParams

    sched = make(n_slots=2, budget=16)
    first = req("a", 5)
    sibling = Request(list(first.prompt_tokens), SamplingParams(max_tokens=3), request_id="a2",
                      prefix_of=first)
    sched.add(first)
    sched.add(sibling)
    assert sibling.status is RequestStatus.HELD
    sched.abort("a")
    assert sibling.status is RequestStatus.WAITING and list(sched.waiting) == [sibling]


def test_the_protocol_answers_the_pools_limits_and_a_users_refused_grammar():
    sched = make(n_slots=2, ctx=64, budget=8, max_num_seqs=1)
    limits = sched.limits()
    assert (limits.ctx_size, limits.n_slots, limits.max_num_batched_tokens,
            limits.max_num_seqs) == (128, 2, 8, 1)
    sched.costly_grammars.ended("alice", "root ::= x")
    assert sched.grammar_refusal("alice", "root ::= x")
    assert sched.grammar_refusal("bob", "root ::= x") is None
    assert sched.grammar_refusal("alice", "root ::= y") is None


def test_siblings_copy_even_a_short_prompt_and_a_colleagues_same_short_prompt_is_computed_again():
    """n > 1: each sibling choice copies the first's prompt from its slot and computes only
    the last token, however short the prompt. A colleague's identical prompt in flight is
    copied only from MIN_PREFIX_REUSE tokens on: this one is computed again."""
    sched = make(n_slots=4, budget=16)
    first = req("a", 5, max_tokens=3)
    siblings = [Request(list(first.prompt_tokens), SamplingParams(max_tokens=3),
                        request_id=f"a{i}", prefix_of=first) for i in (2, 3)]
    colleague = req("b", 5, max_tokens=3)
    for r in (first, *siblings, colleague):
        r.cache_scope = "team"  # one key's (a scope holds its own slots' prompts only)
    runner = ScriptedRunner({r.request_id: [7, 8, 9] for r in (first, *siblings, colleague)})
    for r in (first, *siblings):
        sched.add(r)
    step(sched, runner, sched.schedule())  # the first choice's prompt is in its slot now
    sched.add(colleague)
    run(sched, runner)
    assert [s.cached_tokens for s in siblings] == [4, 4] and colleague.cached_tokens == 0
    prompt_rows = [tokens for batch in runner.batches for _, tokens, start in batch if start < 5]
    assert sorted(len(t) for t in prompt_rows) == [1, 1, 5, 5]  # two prompts, two last tokens


def test_a_batch_or_a_pool_of_nothing_is_refused_naming_its_flag():
    from localserve.engine.slots import SlotPool

    with pytest.raises(ValueError, match="^--max-num-batched-tokens must be at least 1$"):
        make(budget=0)
    with pytest.raises(ValueError, match="^--parallel must be at least 1$"):
        SlotPool(64, 0)


def bob_beside_alice(shared: int, bob_own: int = 8, background: bool = False,
                     slot_used_before: bool = False) -> tuple[int, int]:
    """Alice's 40-token prompt starts computing (8 tokens a step); a step later bob sends one
    whose first `shared` tokens are hers. (Prompt tokens bob computed, tokens he got cached.)"""
    sched = make(n_slots=3, ctx=256, budget=8)
    runner = ScriptedRunner({"before": [7], "alice": [7, 8], "bob": [7, 8]})
    if slot_used_before:  # an earlier request leaves an idle slot ahead of alice's
        sched.add(req("before", 4, max_tokens=1, first=500))
        run(sched, runner)
    alice = Request(list(range(1, 41)), SamplingParams(max_tokens=2), request_id="alice",
                    background=background)
    bob = Request(list(range(1, shared + 1)) + list(range(200, 200 + bob_own)),
                  SamplingParams(max_tokens=2), request_id="bob")
    sched.add(alice)
    step(sched, runner, sched.schedule())
    before = sched.stats.prompt_tokens_computed
    sched.add(bob)
    run(sched, runner)
    assert bob.output_tokens == [7, 8]
    return sched.stats.prompt_tokens_computed - before - (40 - 8), bob.cached_tokens


def test_a_colleague_sharing_a_prompt_in_the_making_waits_for_it_then_copies_it():
    """Alice and bob's editors send the same system prompt a moment apart: bob's admission
    waits while alice's slot computes that part, then copies it (llama.cpp shares the cells)
    and computes only his own tokens; from MIN_PREFIX_REUSE (16) shared tokens on, whichever
    slot alice's is. The same whole prompt computes its last token only (for its own
    logits). Beside a background task's prompt in the making nobody waits: bob computes his."""
    assert bob_beside_alice(32) == (8, 32)
    assert bob_beside_alice(32, slot_used_before=True) == (8, 32)
    assert bob_beside_alice(16) == (8, 16)
    assert bob_beside_alice(15) == (23, 0)
    assert bob_beside_alice(40, bob_own=0) == (1, 39)
    assert bob_beside_alice(32, background=True) == (40, 0)


@pytest.mark.parametrize("keys, between, turn2, placed", [
    ((None, None), 0, True, {"new": (1, 20), "turn2": (0, 51)}),
    (("alice", "bob"), 0, True, {"new": (1, 0), "turn2": (0, 51)}),
    ((None, None), 2, True, {"new": (0, 20), "x0": (1, 0)}),
    ((None, None), 0, False, {"new": (0, 20)}),
])
def test_a_colleague_arriving_with_a_conversation_leaves_its_cached_slot_to_it(
        keys, between, turn2, placed):
    """Two requests admitted at once, a colleague's new chat first: it shares only the chat
    template's opening with every slot (with keys: nothing), so any slot serves it as well; it
    takes the one no one waiting would reuse, not the least recently used that holds the
    conversation whose next turn waits behind it (which would compute its whole history
    again). Only the next few waiting (one per slot) are asked: with two requests between,
    the turn is too far back to keep its slot. Alone, the chat's own best slot is not kept
    from it: the least recently used."""
    owner, colleague = keys
    opening = list(range(1, 21))
    sched = make(n_slots=2, ctx=256, budget=256)
    runner = ScriptedRunner({"turn1": [9, EOS], "other": [9, 9, 9, EOS], "new": [9, EOS],
                             "turn2": [9, EOS], "x0": [9, EOS], "x1": [9, EOS]})

    def ask(rid, tokens, key):
        sched.add(Request(tokens, SamplingParams(max_tokens=4), request_id=rid, user=key,
                          cache_scope=key))

    ask("turn1", opening + list(range(100, 130)), owner)
    ask("other", opening + list(range(200, 230)), owner)
    run(sched, runner)  # the conversation's slot is the least recently used
    ask("new", opening + list(range(300, 330)), colleague)
    for i in range(between):
        ask(f"x{i}", list(range(500 + 50 * i, 530 + 50 * i)), colleague)
    if turn2:
        ask("turn2", opening + list(range(100, 130)) + [9] + list(range(400, 410)), owner)
    plan = sched.schedule()
    assert {a.request.request_id: (a.slot_id, a.kept_tokens) for a in plan.admitted} == placed
