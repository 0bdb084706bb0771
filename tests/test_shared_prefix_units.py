"""A prompt in the making is shared (reuse.py, PrefixBook._in_flight): colleagues who send one
system prompt at once have it computed once and copied (llama.cpp shares the cells), within
one cache scope only, and a chat never waits on a background task's prompt (fake runner with
llama.cpp's sequences, no model)."""

from localserve.engine.prompt_cache import PromptCache
from localserve.engine.scheduler import Scheduler
from localserve.engine.slots import SlotPool

from fakes import FakeVocab, PositionalRunner, req, run_all

SYSTEM = 200  # the shared prompt's tokens; each colleague adds a question of QUESTION tokens
QUESTION = 10


def colleague(number: int, scope: str | None = None, background: bool = False):
    """The shared system prompt (tokens 1..200) and this colleague's own question."""
    r = req(f"c{number}", SYSTEM, max_tokens=6)
    r.prompt_tokens += list(range(1000 * (number + 1), 1000 * (number + 1) + QUESTION))
    r.cache_scope, r.background = scope, background
    return r


def scheduler(n_slots=4):
    return Scheduler(SlotPool(4096, n_slots, n_ctx_per_slot=4096), FakeVocab(), 64,
                     prompt_cache=PromptCache(10_000_000))


def serve(requests, n_slots=4):
    sched = scheduler(n_slots)
    out, finish = run_all(sched, PositionalRunner(4096), requests)
    return sched, out, finish


def alone(number: int) -> list[int]:
    """What a colleague's question gets when nobody else is served."""
    _, out, _ = serve([colleague(number)], n_slots=1)
    return out[f"c{number}"]


def test_colleagues_sending_one_system_prompt_at_once_compute_it_once_and_get_the_same_answers():
    requests = [colleague(n) for n in range(4)]
    sched, out, finish = serve(requests)
    assert sched.stats.prompt_tokens_computed == SYSTEM + 4 * QUESTION
    assert [r.cached_tokens for r in requests] == [0, SYSTEM, SYSTEM, SYSTEM]
    assert [r.prefix_source for r in requests] == [None, "slot", "slot", "slot"]
    assert all(out[f"c{n}"] == alone(n) for n in range(4))  # a wrong copy changes the answer


def test_another_keys_prompt_in_the_making_is_never_shared():
    requests = [colleague(0, scope="alice"), colleague(1, scope="bob")]
    sched, out, _ = serve(requests)
    assert sched.stats.prompt_tokens_computed == 2 * (SYSTEM + QUESTION)
    assert [r.cached_tokens for r in requests] == [0, 0]


def test_a_chat_never_waits_for_a_background_tasks_prompt():
    """A task sits out the steps in which a chat waits (scheduler invariant 9): a chat waiting
    for the task's prompt would wait for ever. It copies what the task computed and computes the rest itself."""
    sched, runner = scheduler(), PositionalRunner(4096)
    task = colleague(0, background=True)
    sched.add(task)
    for _ in range(2):  # the task alone: small steps, its prompt half computed
        plan = sched.schedule()
        sched.update(plan, runner.decode(plan))
    computed = sched.pool.slots[0].n_cached
    assert 0 < computed < SYSTEM
    chat, answer = colleague(1), []
    sched.add(chat)
    for _ in range(200):
        plan = sched.schedule()
        answer += [t for r, ev in sched.update(plan, runner.decode(plan)) if r is chat
                   for t in ev.token_ids]
        if chat.finish_reason is not None:
            break
    assert answer == alone(1) and chat.cached_tokens == computed  # the rest, itself


def test_a_request_waiting_for_a_prompt_in_the_making_holds_up_nobody_behind_it():
    """Alice's second request waits for her first one's system prompt; Bob's, behind it in
    the queue, takes the step's budget left beside the last chunk of that prompt."""
    sched, runner = scheduler(n_slots=3), PositionalRunner(4096)
    first, second, bob = colleague(0, "alice"), colleague(1, "alice"), req("bob", 30, first=5000)
    bob.cache_scope = "bob"
    admitted_at = {}
    for r in (first, second, bob):
        sched.add(r)
    for step in range(40):
        plan = sched.schedule()
        admitted_at.update({a.request.request_id: step for a in plan.admitted})
        sched.update(plan, runner.decode(plan))
    assert admitted_at["bob"] < admitted_at["c1"] and second.cached_tokens == SYSTEM
