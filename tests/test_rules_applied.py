"""Pure tests of rules where they are applied, not only where they are computed: each kills a
hand mutant that survived every other pure test (issue: one serving path in api/).

- the ledger bills an n = 3 request's prompt once (its rows, not only the events);
- a quota hold is released when the app raises, not only when it returns;
- the drafter's acceptance count is the drafts that held, not one more or less;
- the prompt cache restores at MIN_PREFIX_REUSE tokens beyond a slot's prefix and not one
  fewer, into the least recently used idle slot."""

import asyncio

from localserve.api.limits import ReleaseReservations
from localserve.engine.plan import SeqChunk
from localserve.engine.prompt_cache import PromptCache
from localserve.engine.request import Request, SamplingParams
from localserve.engine.scheduler import Scheduler
from localserve.engine.slots import MIN_PREFIX_REUSE, SlotPool
from localserve.ledger import LedgerObserver
from localserve.quotas import Quota, QuotaKeeper

from fakes import EOS, FakeVocab, ScriptedRunner, req, run


class Rows:
    def __init__(self):
        self.rows = []

    def record(self, row):
        self.rows.append(row)


def test_the_ledger_bills_an_n_of_3_requests_prompt_once():
    sched = Scheduler(SlotPool(256 * 3, 3), FakeVocab(), 64)
    prompt = list(range(1, 41))
    first = Request(prompt, SamplingParams(max_tokens=3), request_id="c0")
    siblings = [Request(prompt, SamplingParams(max_tokens=3), request_id=f"c{i}", prefix_of=first)
                for i in (1, 2)]
    for r in (first, *siblings):
        sched.add(r)
    ledger = Rows()
    observer = LedgerObserver(ledger, lambda: "m")
    runner = ScriptedRunner({r.request_id: [7, 8, 9] for r in (first, *siblings)})
    for _ in range(50):
        if not sched.has_work():
            break
        plan = sched.schedule()
        for request, event in sched.update(plan, runner.decode(plan).sampled):
            observer.on_event(request, event)
    assert len(ledger.rows) == 3
    assert sum(row["prompt_tokens"] for row in ledger.rows) == len(prompt)
    assert sum(row["completion_tokens"] for row in ledger.rows) == 9


def test_a_quota_hold_is_released_when_the_app_raises():
    keeper = QuotaKeeper({"alice": Quota(max_concurrent=1)})

    async def failing_app(scope, receive, send):
        scope["state"]["quota_hold"] = keeper.reserve("alice", 0, 0)
        raise RuntimeError("the response ended by an exception")

    async def call():
        try:
            await ReleaseReservations(failing_app)({"type": "http", "state": {}}, None, None)
        except RuntimeError:
            pass

    asyncio.run(call())
    keeper.reserve("alice", 0, 0)  # max_concurrent 1: the place was given back


def test_the_acceptance_count_is_the_drafts_that_held():
    sched = Scheduler(SlotPool(256, 1), FakeVocab(), 64)
    request = req("r", 20)
    sched.add(request)
    sched.update(plan := sched.schedule(), {0: 5})

    class Drafter:
        told = None

        def feedback(self, drafted, accepted):
            self.told = (drafted, accepted)

    request.drafter = Drafter()
    chunk = SeqChunk(0, request, [5, 6, 7, 8], 20, True, drafts=3)
    assert sched.drafts.take(chunk, [6, 7, 1]) == [6, 7, 1]  # two drafts held, then a miss
    assert (sched.stats.draft_tokens, sched.stats.draft_tokens_accepted) == (3, 2)
    assert request.drafter.told == (3, 2)
    assert sched.drafts.kept_in_cache(chunk, [6, 7, 1]) == [5, 6, 7]
    assert plan is not None


def restore_case(extra: int):
    """Two slots: one holds a 20-token prefix of the prompt (its best reuse), the other is
    idle and older; the cache holds the prompt's first 20 + extra tokens."""
    cache = PromptCache(1_000_000)
    sched = Scheduler(SlotPool(512, 2), FakeVocab(), 512, prompt_cache=cache)
    runner = ScriptedRunner({"old": [9, EOS], "near": [9, EOS], "again": [9, EOS]})
    sched.add(req("old", 30, first=500))
    run(sched, runner)
    sched.add(req("near", 20, first=1))
    run(sched, runner)
    cache.put(None, list(range(1, 21 + extra)), "state", 10)
    again = req("again", 20 + extra + 5, first=1)
    sched.add(again)
    plan = sched.schedule()
    return sched, plan, again


def test_a_restore_needs_min_prefix_reuse_tokens_beyond_the_slots_and_takes_the_lru_slot():
    sched, plan, _ = restore_case(MIN_PREFIX_REUSE - 1)
    assert not [a for a in plan.admitted if a.restore]  # one token short: the slot's prefix
    sched, plan, again = restore_case(MIN_PREFIX_REUSE)
    restores = [a for a in plan.admitted if a.restore]
    assert len(restores) == 1 and restores[0].kept_tokens == 20 + MIN_PREFIX_REUSE
    holder = next(s for s in sched.pool.slots if s.request is again)
    assert holder.slot_id == restores[0].slot_id
    assert holder.slot_id == 0  # the least recently used idle slot ("old"'s), not "near"'s
