"""A chat never waits for a step of background tasks: a chat that arrives while a step serves
tasks only stops it (Runner.interrupt), and the step's rows are planned again after the chat's
prompt. Pure tests (fake runner with llama.cpp's sequences, the real loop thread); the real
model's side is in tests/test_interrupts_model.py."""

import threading

from localserve.engine.errors import Interrupted
from localserve.engine.loop import EngineLoop
from localserve.engine.prompt_cache import PromptCache
from localserve.engine.request import Request, SamplingParams
from localserve.engine.scheduler import Scheduler
from localserve.engine.slots import SlotPool
from conftest import wait_for
from fakes import FakeVocab, PositionalRunner


def request(rid, first, n_prompt=12, max_tokens=8, background=False, scope=None):
    r = Request(list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens,
                ignore_eos=True), request_id=rid, user="bob", cache_scope=scope)
    r.background = background
    return r


def scheduler(prompt_cache=None):
    return Scheduler(SlotPool(1024, 2, n_ctx_per_slot=512), FakeVocab(), 64, prompt_cache=prompt_cache)


def run(sched, runner, requests, interrupting=False):
    """Until idle; `interrupting`: the 1st, 3rd, 5th... step of tasks only is stopped midway."""
    for r in requests:
        sched.add(r)
    out, tasks_only, stopped = {r.request_id: [] for r in requests}, 0, 0
    for _ in range(1000):
        if not sched.has_work():
            assert sched.stats.interrupted_steps == stopped
            return out
        plan = sched.schedule()
        tasks_only += plan.stop_rule.tasks_only
        if interrupting and plan.stop_rule.tasks_only and tasks_only % 2:
            runner.interrupt()
        try:
            result = runner.decode(plan)
        except Interrupted as interrupted:
            sched.interrupted(plan, interrupted.saved)
            stopped += 1
            continue
        for r, event in sched.update(plan, result):
            out[r.request_id].extend(event.token_ids)
    raise AssertionError("did not finish")


def test_interrupted_steps_of_tasks_change_no_answer_and_keep_their_saves():
    def requests():
        return [request("chat", 1, n_prompt=20, scope="bob"), request("title", 100, background=True),
                request("tags", 200, n_prompt=40, background=True)]

    alone = run(scheduler(), PositionalRunner(1024), requests())
    cache = PromptCache(10**6)
    sched, runner = scheduler(cache), PositionalRunner(1024)
    first = run(sched, runner, requests()[:1])  # the chat's turn ends
    assert first["chat"] == alone["chat"]
    stopped = run(sched, runner, requests()[1:], interrupting=True)
    assert stopped == {k: alone[k] for k in ("title", "tags")}
    assert sched.stats.interrupted_steps >= 2  # the first run's steps were never stopped
    # the step that took the chat's idle slot saved it first; interrupted, the save is kept
    assert cache.stats.saves >= 1 and cache.holds(list(range(1, 21)), "bob")


class ColleagueArrives(PositionalRunner):
    """While it decodes the `at_step`-th step, `arrival` is submitted (as the HTTP thread
    would); or, with `held_for`, announced first (chat_on_its_way, from another thread) and
    submitted once that many steps were stopped. The steps it runs are recorded as
    (request ids, interrupted)."""

    def __init__(self, arrival, at_step, held_for):
        super().__init__(1024)
        self.arrival, self.at_step, self.held_for = arrival, at_step, held_for
        self.steps, self.loop, self.on_its_way = [], None, threading.Event()

    def decode(self, plan):
        if len(self.steps) == self.at_step:
            if self.held_for:
                threading.Thread(target=self._tokenize, daemon=True).start()
                assert self.on_its_way.wait(10), "the chat never came on its way"
            else:
                self.loop.submit(self.arrival)
        ids = sorted(c.request.request_id for c in plan.chunks)
        try:
            out = super().decode(plan)
        except Interrupted:
            self.steps.append((ids, True))
            raise
        self.steps.append((ids, False))
        return out

    def _tokenize(self):
        with self.loop.chat_on_its_way():
            self.on_its_way.set()
            wait_for(lambda: sum(stopped for _, stopped in self.steps) >= self.held_for, 10,
                     "steps stopped while the chat is tokenized", interval=0.001)
            self.loop.submit(self.arrival)


def serve(arrival, running, at_step=2, held_for=0, wait_s=None, stale_stop=False):
    """The real loop thread, one request running, `arrival` (if any) submitted during step
    `at_step` (or held: ColleagueArrives); the steps it ran and the tokens each request got.
    `wait_s`: the loop's arrival window; `stale_stop`: a stop asked before the loop starts."""
    runner = ColleagueArrives(arrival, at_step, held_for)
    loop = runner.loop = EngineLoop(scheduler(), runner)
    loop.arrival_window_s = loop.arrival_window_s if wait_s is None else wait_s
    got, finished, done = {}, set(), threading.Event()
    served = [r for r in (running, arrival) if r is not None]
    for r in served:
        def emit(event, rid=r.request_id):
            got.setdefault(rid, []).extend(event.token_ids)
            if event.finished:
                finished.add(rid)
                if len(finished) == len(served):
                    done.set()
        r.emit = emit
    if stale_stop:
        runner.interrupt()
    loop.start()
    try:
        loop.submit(running)
        assert done.wait(30), f"not finished: {runner.steps}"
    finally:
        loop.stop()
        loop.join(10)
    return runner.steps, got


def test_a_chat_that_arrives_during_a_step_of_tasks_stops_it_and_goes_first():
    title = request("title", 100, n_prompt=4, background=True)
    steps, got = serve(request("chat", 1, n_prompt=20), title)
    assert steps[2] == (["title"], True)  # the title's row, stopped for the chat
    assert steps[3] == (["chat"], False)  # the chat's prompt alone (the title sits it out)
    assert sum(stopped for _, stopped in steps) == 1
    assert len(got["title"]) == 8 and len(got["chat"]) == 8


def test_a_task_or_a_step_with_a_chat_in_it_is_never_stopped():
    title = request("title", 100, n_prompt=4, background=True)
    steps, got = serve(request("tags", 200, n_prompt=4, background=True), title)
    assert not any(stopped for _, stopped in steps) and len(got["tags"]) == 8
    chat = request("chat", 1, n_prompt=4)
    steps, got = serve(request("chat2", 300, n_prompt=4), chat)
    assert not any(stopped for _, stopped in steps) and len(got["chat2"]) == 8


def test_a_chat_that_arrives_during_a_step_of_a_long_prompt_stops_it_once():
    """A colleague's long prompt computes, nothing sampled: a chat that arrives stops the step
    and starts in the next one beside it; that step is never stopped (the prompt gets on)."""
    document = request("document", 1000, n_prompt=300)
    steps, got = serve(request("chat", 1, n_prompt=20), document, at_step=1)
    assert steps[1] == (["document"], True)
    assert steps[2] == (["chat", "document"], False)
    assert sum(stopped for _, stopped in steps) == 1
    assert len(got["document"]) == 8 and len(got["chat"]) == 8
    # another long prompt arriving gains nothing from stopping it: it waits for the step
    steps, got = serve(request("other", 2000, n_prompt=300), request("document", 1000, n_prompt=300),
                       at_step=1)
    assert not any(stopped for _, stopped in steps) and len(got["other"]) == 8


def test_no_step_of_tasks_is_made_while_a_chat_is_tokenized():
    """From the moment a chat is accepted (before its prompt is tokenized) the tasks' steps
    stop, each at once however often the loop plans one (here it waits for nothing), until
    the chat's prompt goes first."""
    title = request("title", 100, n_prompt=4, background=True)
    steps, got = serve(request("chat", 1, n_prompt=20), title, held_for=3, wait_s=0)
    chat_first = steps.index((["chat"], False))
    assert steps[2:chat_first] and all(s == (["title"], True) for s in steps[2:chat_first])
    assert len(got["title"]) == 8 and len(got["chat"]) == 8


def test_a_stop_asked_after_a_step_ended_does_not_stop_the_next():
    """interrupt() stops the decode in flight or else the next one: a chat that came as a step
    of tasks ended (it read that step's rule) asked too late, and the next step, its own maybe,
    runs (the loop forgets the stale stop before it publishes the next step's rule)."""
    title = request("title", 100, n_prompt=4, background=True)
    steps, got = serve(None, title, at_step=99, stale_stop=True)  # asked between steps
    assert steps[0] == (["title"], False) and len(got["title"]) == 8


def test_a_stopped_step_of_tasks_waits_for_the_chat_rather_than_plan_and_stop_again():
    """The chat is submitted once one step was stopped: the loop, waiting for it, stopped no
    other (planning and stopping again, it stops dozens while the chat comes), and woke when
    the chat was submitted, not at the end of its window (600 s here, past serve's deadline)."""
    title = request("title", 100, n_prompt=4, background=True)
    steps, _ = serve(request("chat", 1, n_prompt=20), title, held_for=1, wait_s=600)
    assert steps[2:4] == [(["title"], True), (["chat"], False)]


def test_a_task_is_told_by_its_last_message():
    """What makes way for nobody (a frontend's task) and what steps of tasks make way for (any
    other chat), on the request every chat-shaped API is translated into (Ollama's too)."""
    from localserve.api.schemas import ChatCompletionRequest
    from localserve.api.serving import background_task

    def last(role, content):
        return background_task(ChatCompletionRequest(messages=[
            {"role": "system", "content": "You help."}, {"role": role, "content": content}]))

    title = "### Task:\nGenerate a title.\n### Chat History:\n<chat_history>\nUSER: hi\n</chat_history>"
    assert last("user", title) and last("user", "\n" + title)
    assert not last("assistant", title) and not last("user", "### Task:\nno chat quoted")
    assert not background_task(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]))
