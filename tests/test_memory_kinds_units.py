"""Pure tests of the scheduler on a model whose sequences cannot be cut back to a prefix (a
hybrid or recurrent state, or window layers: SlotPool(cuts_back=False)): slots reused whole or
not at all, a checkpoint of each new prompt before its last token, checkpoints kept beside the
longer turns that extend them, no copies, no drafts; and the same answers as on attention
(fakes.RecurrentRunner fails any plan that would cut a recurrent state)."""

from localserve.engine.prompt_cache import BLOCK, PromptCache
from localserve.engine.reuse import after_text, branch_point, prompt_stops
from localserve.engine.request import Request, SamplingParams
from localserve.engine.scheduler import Scheduler
from localserve.engine.slots import SlotPool

from fakes import FakeVocab, PositionalRunner, RecurrentRunner, run_all


def tokens(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def test_a_whole_only_cache_finds_entries_all_of_which_start_the_prompt_and_keeps_earlier_turns():
    cache = PromptCache(10_000, whole_only=True)
    cache.put("a", tokens(1, 40), "turn 1", 40)
    cache.put("a", tokens(1, 80), "turn 2", 80)  # extends turn 1: both stay (checkpoints)
    assert sorted(e.state for e in cache.ram.values()) == ["turn 1", "turn 2"]
    entry, shared = cache.lookup(tokens(1, 70) + [7] * 20, "a")  # diverges inside turn 2
    assert (entry.state, shared) == ("turn 1", 40)  # the longest entry that starts it whole
    assert cache.lookup(tokens(1, 90), "a")[0].state == "turn 2"
    assert cache.lookup(tokens(1, 30) + [7] * 20, "a") is None  # no entry starts it whole
    assert cache.holds(tokens(1, 40), "a") and not cache.holds(tokens(1, 60), "a")
    assert cache.lookup(tokens(1, 90), "b") is None


def test_a_slot_that_cannot_be_cut_back_is_reused_whole_or_not_at_all():
    for cuts_back, expected in ((True, 40), (False, 0)):
        pool = SlotPool(512, 1, cuts_back=cuts_back)
        pool.slots[0].computed(tokens(1, 60))
        slot, keep = pool.best_idle_slot(tokens(1, 40) + [7] * 30)  # shares 40 of its 60
        assert keep == expected
    slot, keep = pool.best_idle_slot(tokens(1, 60) + [7] * 10)  # all it holds, and more
    assert keep == 60


def test_a_window_models_sequence_within_its_window_is_cut_back_as_on_attention():
    """None of its cells has left the window yet (llama-server's rule: the cache's oldest
    position at most the cut point less the window): a Regenerate or an edited turn keeps
    the shared prefix; past the window, the slot is reused whole or not at all."""
    for held, expected in ((60, 40), (64, 40), (65, 0)):
        pool = SlotPool(512, 1, cuts_back=False, window=64)
        pool.slots[0].computed(tokens(1, held))
        slot, keep = pool.best_idle_slot(tokens(1, 40) + [7] * 30)  # shares 40 of it
        assert keep == expected, held
    slot, keep = pool.best_idle_slot(tokens(1, 65) + [7] * 10)  # all it holds, and more
    assert keep == 65


def make(cuts_back: bool, n_slots: int = 2, ctx: int = 512, speculative=False):
    cache = PromptCache(1_000_000, whole_only=not cuts_back)
    sched = Scheduler(SlotPool(ctx, n_slots, cuts_back=cuts_back), FakeVocab(), 64,
                      prompt_cache=cache, speculative=speculative)
    return sched, cache


def ask(rid: str, prompt: list[int], n_tokens: int = 6, n: int = 1) -> list[Request]:
    first = Request(list(prompt), SamplingParams(max_tokens=n_tokens), request_id=rid)
    siblings = [Request(list(prompt), SamplingParams(max_tokens=n_tokens),
                        request_id=f"{rid}.{i}", prefix_of=first) for i in range(1, n)]
    return [first, *siblings]


def test_a_new_prompt_stops_short_of_its_end_and_is_saved_before_its_last_tokens():
    sched, cache = make(cuts_back=False)
    sched.add(ask("doc", tokens(1, 40))[0])
    first = sched.schedule()
    assert [len(c.tokens) for c in first.chunks] == [36] and not first.chunks[0].sample
    runner = RecurrentRunner(512)
    sched.update(first, runner.decode(first))
    last = sched.schedule()
    assert [(s.slot_id, len(s.tokens)) for s in last.saves] == [(0, 36)]
    assert [(c.tokens, c.sample) for c in last.chunks] == [(tokens(37, 4), True)]
    sched.update(last, runner.decode(last))
    assert cache.holds(tokens(1, 36), None)


def conversation(answers: dict) -> list[list[Request]]:
    """Turn 1; a follow-up; Regenerate; turn 1 again; turn 1 with two choices; then turn 3
    after seven colleagues with the same system prompt took every slot. Prompts follow the answers given so far."""
    system = tokens(1, 3 * BLOCK)
    turn1 = system + tokens(500, 20)
    rounds = [lambda: ask("turn1", turn1)]
    turn2 = lambda: turn1 + answers["turn1"] + tokens(600, 10)  # noqa: E731
    rounds += [lambda: ask("turn2", turn2()), lambda: ask("regen", turn2()),
               lambda: ask("turn1-again", turn1), lambda: ask("two", turn1, n=2)]
    rounds.append(lambda: [r for i in range(7)  # at once, the same system prompt
                           for r in ask(f"colleague{i}", system + tokens(1000 * (i + 1), 30))])
    rounds.append(lambda: ask("turn3", turn2() + answers["turn2"] + tokens(700, 10)))
    return rounds


def serve(sched, runner) -> dict:
    answers: dict = {}
    for make_round in conversation(answers):
        out, finish = run_all(sched, runner, make_round())
        assert all(reason == "length" for reason in finish.values()), finish
        answers.update(out)
    return answers


def test_a_conversation_on_a_recurrent_model_cuts_nothing_and_answers_as_on_attention():
    attention, _ = make(cuts_back=True)  # (the fake runner does not check drafts)
    expected = serve(attention, PositionalRunner(512))
    recurrent, cache = make(cuts_back=False, speculative=True)
    runner = RecurrentRunner(512)
    assert serve(recurrent, runner) == expected
    assert expected["two"] == expected["two.1"] == expected["turn1"]
    assert runner.restored > 0 and cache.stats.hits >= 4  # regen, turn 1 again, a sibling, turn 3
    assert recurrent.stats.draft_tokens == 0  # asked for, and off


def test_colleagues_sharing_a_system_prompt_restore_it_from_the_checkpoint_at_their_branch():
    """The second colleague's prompt parts from the first's after their system prompt: it is
    checkpointed there, and every later colleague restores it instead of computing it."""
    sched, cache = make(cuts_back=False, n_slots=1)
    system = tokens(1, 4 * BLOCK)
    colleagues = [ask(f"c{i}", system + tokens(1000 * (i + 1), 20))[0] for i in range(3)]
    runner = RecurrentRunner(512)
    for colleague in colleagues:
        run_all(sched, runner, [colleague])
    assert cache.holds(system, None)  # saved at the second colleague's branch point
    assert [c.cached_tokens for c in colleagues] == [0, 0, len(system)]


def chat_request(prompt: list[int], turns: tuple[int, ...], cached: int = 0) -> Request:
    req = Request(list(prompt), SamplingParams(max_tokens=4), user_turns=turns)
    req.cached_tokens = cached
    return req


def test_a_chats_prompt_stops_where_llama_servers_batch_does():
    """Where the first user message starts (nothing cached: a fresh conversation), where the
    last does, and 516 and 4 tokens before the end (server-context.cpp): both servers then
    compute the same rows in the same calls and a greedy answer comes out the same."""
    assert sorted(prompt_stops(chat_request(tokens(1, 600), (20, 300, 450)))) == [20, 84, 450, 596]
    assert sorted(prompt_stops(chat_request(tokens(1, 600), (20, 300, 450), cached=200))) == \
        [84, 450, 596]
    assert sorted(prompt_stops(chat_request(tokens(1, 60), ()))) == [56]  # a raw prompt
    image = [-1 - i for i in range(256)]  # an image's rows across 516 before the end
    assert sorted(prompt_stops(chat_request(tokens(1, 200) + image + tokens(500, 400),
                                            (0,)))) == [852]
    sched, _ = make(cuts_back=False)
    sched.add(chat_request(tokens(1, 60), (8, 30)))
    runner, lengths = RecurrentRunner(512), []
    while (plan := sched.schedule()).chunks:
        lengths += [len(c.tokens) for c in plan.chunks]
        sched.update(plan, runner.decode(plan))
        if plan.chunks[0].sample:
            break
    assert lengths == [8, 22, 26, 4]


def test_a_chats_branch_from_a_cached_prompt_is_checkpointed_where_its_message_starts():
    """Colleagues' chats share a system prompt and the next message's header: the checkpoint is
    where that message starts (as llama-server's), not a few header tokens into it."""
    sched, cache = make(cuts_back=False, n_slots=1)
    system, header = tokens(1, 4 * BLOCK), [900, 901]
    colleagues = [chat_request(system + header + tokens(1000 * (i + 1), 20), (len(system),))
                  for i in range(3)]
    runner = RecurrentRunner(512)
    for colleague in colleagues:
        run_all(sched, runner, [colleague])
    assert cache.holds(system, None) and not cache.holds(system + header, None)
    assert colleagues[2].cached_tokens == len(system)
    sched, cache = make(cuts_back=False, n_slots=1)  # Gemma's: the system prompt in the message
    colleagues = [chat_request([7] + system + tokens(1000 * (i + 1), 20), (1,)) for i in range(3)]
    runner = RecurrentRunner(512)
    for colleague in colleagues:
        run_all(sched, runner, [colleague])
    assert cache.holds([7] + system, None) and colleagues[2].cached_tokens == len(system) + 1


def test_a_chunk_stops_after_text_and_a_branch_is_moved_to_its_message_start():
    """Boundaries: a stop after the first token or at the very end, never inside or right
    after an image's rows (token id 0 is text); a branch moved back to the latest user message
    start at or before it, unless that start is under a block."""
    req = chat_request([0, 6, -1, -2, 7], ())
    assert [after_text(req, at) for at in range(7)] == [False, True, True, False, False, True,
                                                          False]
    assert branch_point(chat_request(tokens(1, 60), (16, 40)), 40) == 40
    assert branch_point(chat_request(tokens(1, 60), (16, 40)), 39) == 16
    assert branch_point(chat_request(tokens(1, 60), (15, 50)), 30) == 30  # under a block
    assert branch_point(chat_request(tokens(1, 60), ()), 30) == 30  # a raw prompt
