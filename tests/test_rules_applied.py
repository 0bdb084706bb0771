"""Pure tests of rules where they are applied, not only where they are computed: each kills a
hand mutant that survived every other pure test (issue: one serving path in api/).

- the ledger bills an n = 3 request's prompt once (its rows, not only the events);
- a quota hold is released when the app raises, not only when it returns;
- the drafter's acceptance count is the drafts that held, not one more or less;
- the prompt cache restores at MIN_PREFIX_REUSE tokens beyond a slot's prefix and not one
  fewer, into the least recently used idle slot."""

import asyncio

from localserve.api.limits import ReleaseReservations
from localserve.engine.drafts import MATCH_CLASSES
from localserve.engine.plan import SeqChunk, StepOutput
from localserve.engine.prompt_cache import PromptCache
from localserve.engine.request import Request, SamplingParams
from localserve.engine.scheduler import Scheduler
from localserve.engine.slots import MIN_PREFIX_REUSE, SlotPool
from localserve.office.ledger import LedgerObserver
from localserve.office.quotas import Quota, QuotaKeeper

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
        for request, event in sched.update(plan, runner.decode(plan)):
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
    sched.update(plan := sched.schedule(), StepOutput({0: [5]}))

    class Drafter:
        told = None

        match = 40

        def feedback(self, drafted, accepted):
            self.told = (drafted, accepted)

    request.drafter = Drafter()
    chunk = SeqChunk(0, request, [5, 6, 7, 8], 20, True, drafts=3)
    assert sched.drafts.take(chunk, [6, 7, 1]) == [6, 7, 1]  # two drafts held, then a miss
    assert (sched.stats.draft_tokens, sched.stats.draft_tokens_accepted) == (3, 2)
    assert request.drafter.told == (3, 2)
    assert sched.drafts.acceptance.p(40) > 1 / 3 == sched.drafts.acceptance.p(2)  # its class's
    assert sched.drafts.kept_in_cache(chunk, [6, 7, 1]) == [5, 6, 7]
    assert sched.schedule().trims == [(0, 23)]  # the missed draft's row, in the next plan
    assert sched.schedule().trims == []  # planned once
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


# ---- where drafts go (DraftBook.add) and what a restore counts (PrefixBook) ----------------
LOOP = [11, 12, 13, 14, 15, 16, 17, 18] * 3  # a prompt whose n-grams repeat: drafts follow


def decoding(n: int, held: float = 0.99, budget: int = 64, n_ctx_per_slot: int | None = None,
             max_tokens: int = 100, n_ctx: int = 256, logprobs=(None,)):
    """A scheduler whose n requests all decode (one prefill step of them all done), drafts
    measured to hold with chance `held` and every step as cheap as one row (a GPU's curve):
    its next plan. logprobs: each request's, in order (the last one repeats)."""
    sched = Scheduler(SlotPool(n_ctx * n, n, n_ctx_per_slot), FakeVocab(), budget, prefill_budget=4096,
                      speculative=True)
    sched.drafts.acceptance.held = [held * 1000] * len(MATCH_CLASSES)
    sched.drafts.acceptance.missed = [(1 - held) * 1000] * len(MATCH_CLASSES)
    sched.drafts.cost.observe(1, 0.010)
    sched.drafts.cost.observe(256, 0.010)
    wanted = lambda i: logprobs[min(i, len(logprobs) - 1)]  # noqa: E731
    requests = [Request(list(LOOP), SamplingParams(max_tokens=max_tokens, logprobs=wanted(i)),
                        request_id=f"r{i}") for i in range(n)]
    for i, r in enumerate(requests):
        r.cache_scope = f"key {i}"  # one prompt each: none waits to copy another's (reuse.py)
        sched.add(r)
    plan = sched.schedule()
    sched.update(plan, StepOutput({c.slot_id: [11] for c in plan.chunks if c.sample}))
    return sched.schedule()


def drafts(plan) -> list[int]:
    return [c.drafts for c in plan.chunks]


def test_only_steps_of_decode_and_draft_rows_price_drafts():
    """A prompt's rows want no logits and come in a short context: a step of them is no
    measure of what a draft step of that many rows costs."""
    sched = Scheduler(SlotPool(256, 1), FakeVocab(), 64, prefill_budget=4096, speculative=True)
    sched.add(Request(list(LOOP), SamplingParams(max_tokens=50), request_id="r"))
    prompt = sched.schedule()
    assert prompt.num_tokens == len(LOOP) and prompt.num_decode_rows == 0
    sched.update(prompt, StepOutput({0: [11]}, decode_s=0.024))
    assert sched.drafts.cost.view() == {}
    step = sched.schedule()
    assert step.num_decode_rows == len(step.chunks) == 1
    sched.update(step, StepOutput({0: [12]}, decode_s=0.030))
    assert list(sched.drafts.cost.view().values()) == [30.0]


def test_drafts_go_to_decode_rows_as_many_as_pay_while_the_budget_lasts():
    assert drafts(decoding(2)) == [16, 16]  # a 17-token match earns 16 (COPYING): copying pays
    assert all(0 < d <= 16 for d in drafts(decoding(2, held=0.5)))  # rows cost nothing: drafts pay
    assert drafts(decoding(2, held=0.0)) == [0, 0]  # drafts that never hold: none
    assert drafts(decoding(1, n_ctx_per_slot=256)) == [16]  # borrowing from the pool drafts too
    assert drafts(decoding(1, logprobs=(2,))) == [0]  # drafted rows give no log-probabilities
    assert drafts(decoding(2, logprobs=(2, None))) == [0, 16]  # the next row is still drafted
    assert drafts(decoding(2, budget=2 + 1)) == [1, 0]  # the budget left: one token, in order
    assert drafts(decoding(2, budget=2 + 10)) == [8, 2]  # the first's drafts come off the budget
    assert drafts(decoding(1, max_tokens=3)) == [1]  # room for the answer's last tokens only
    assert drafts(decoding(1, n_ctx=len(LOOP) + 4)) == [2]  # within the slot: 28 - 24 held - 2


def test_a_restore_of_a_whole_prompt_keeps_all_but_its_last_token_and_counts_it_once():
    cache = PromptCache(1_000_000)
    sched = Scheduler(SlotPool(512, 2), FakeVocab(), 512, prompt_cache=cache)
    runner = ScriptedRunner({"first": [9, EOS], "whole": [9, EOS]})
    sched.add(req("first", 30, first=500))
    run(sched, runner)
    length = MIN_PREFIX_REUSE + 1  # one token left to compute for the first logits
    cache.put(None, list(range(1, 1 + length)), "state", 10)
    sched.add(req("whole", length, first=1))
    plan = sched.schedule()
    restored = [a for a in plan.admitted if a.restore]
    assert len(restored) == 1 and restored[0].kept_tokens == length - 1
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)  # "first" missed, "whole" hit
    assert cache.stats.tokens_restored == length - 1


def test_a_removed_keys_drop_reaches_its_colleagues_but_no_one_else_and_no_busy_slot(tmp_path):
    from localserve.engine.prompt_disk import DiskTier

    cache = PromptCache(1_000_000, DiskTier(tmp_path, 1_000_000, "m"))
    for i, scope in enumerate(("alice", "alice:bob@x", "alicex", None)):
        cache.put(scope, list(range(100 * i + 1, 100 * i + 41)), b"s" * 50, 50)
    sched = Scheduler(SlotPool(512, 2), FakeVocab(), 64, prompt_cache=cache)
    mine, theirs = req("mine", 30, first=300), req("theirs", 30, first=400)
    mine.cache_scope, theirs.cache_scope = "alice", "carol"
    for r in (mine, theirs):
        sched.add(r)
    sched.update(plan := sched.schedule(), StepOutput({c.slot_id: [5] for c in plan.chunks if c.sample}))
    assert sched.drop_scope("alice") == 2  # alice's entry and her colleague's, not "alicex"
    assert sorted(str(e.scope) for e in cache.ram.values()) == ["None", "alicex"]
    assert all(s.cached for s in sched.pool.slots)  # busy slots keep what they hold
    assert cache.spill() == 2 and cache.stats.disk_writes == 2
    assert cache.disk_bytes == sum(p.stat().st_size for p in tmp_path.glob("*.cache"))
    entry, _ = cache.lookup(list(range(201, 241)), "alicex")  # written, then evicted by hand
    cache.ram.pop(entry.entry_id)
    cache.nbytes -= entry.nbytes
    entry.state = None
    assert cache.load(entry) and cache.stats.disk_reads == 1 and entry.state == b"s" * 50
    assert Scheduler(SlotPool(512, 2), FakeVocab(), 64).drop_scope("alice") == 0  # no cache
