"""Grammar time charged per key (engine/grammar_shares.py), with a fake runner that reports
grammar CPU seconds for the rows it samples under a grammar, as the real runner measures them."""

import pytest

from fakes import FakeVocab, ScriptedRunner
from localserve.engine.finish import FinishReason
from localserve.engine.grammar_shares import (GRAMMAR_BURST_S, GRAMMAR_SHARE, CostlyGrammars,
                                              GrammarRefused, GrammarShares)
from localserve.engine.plan import StepOutput
from localserve.engine.request import Request, SamplingParams
from localserve.engine.scheduler import Scheduler
from localserve.engine.slots import SlotPool

GRAMMAR = 'root ::= "a"+'
DECODE_S = 0.02  # what the fake model's step takes
GRAMMAR_S = 0.048  # a constrained token, just under the per-request bound (round 5's attack)


class GrammarRunner(ScriptedRunner):
    """Every sampled row under a grammar costs GRAMMAR_S of grammar time; a step DECODE_S."""

    def decode(self, plan):
        out = super().decode(plan)
        out.decode_s = DECODE_S
        out.grammar_s = {c.slot_id: GRAMMAR_S for c in plan.chunks
                         if c.sample and c.request.params.grammar is not None}
        return out


def request(rid, user, grammar=None, n=4):
    return Request(list(range(1, 5)), SamplingParams(max_tokens=n, grammar=grammar),
                   request_id=rid, user=user)


def rows_per_user(n_steps, eve_requests=3, bob=True):
    sched = Scheduler(SlotPool(4 * 1024, 4), FakeVocab(), 64)
    scripts = {f"eve{i}": [5] * 1000 for i in range(eve_requests)} | {"bob": [6] * 1000}
    runner = GrammarRunner(scripts)
    for i in range(eve_requests):
        sched.add(request(f"eve{i}", "eve", GRAMMAR, n=1000))
    if bob:
        sched.add(request("bob", "bob", n=1000))
    rows = {"eve": 0, "bob": 0}
    grammar_s = 0.0
    for _ in range(n_steps):
        plan = sched.schedule()
        out = runner.decode(plan)
        grammar_s += sum(out.grammar_s.values())
        for chunk in plan.chunks:
            rows[chunk.request.user] += 1
        sched.update(plan, out)
    return rows, grammar_s, sched


def test_a_keys_grammar_time_stays_within_its_share_of_the_steps_while_another_key_decodes():
    rows, grammar_s, sched = rows_per_user(200)
    assert rows["bob"] == 200  # bob's stream gets a row in every step
    # eve's three constrained streams cost 0.144 s a step unchecked; charged, about her share
    assert grammar_s <= GRAMMAR_SHARE * DECODE_S * 200 + 3 * GRAMMAR_S + GRAMMAR_BURST_S
    assert rows["eve"] > 0  # she waits, she is not starved
    assert sched.grammar_shares.charged["eve"] == pytest.approx(grammar_s)


def test_grammars_run_every_step_when_nobody_else_needs_the_step():
    rows, _, _ = rows_per_user(50, eve_requests=2, bob=False)
    assert rows["eve"] == 100


def test_debt_is_paid_back_by_the_steps_and_capped():
    shares = GrammarShares()
    sched = Scheduler(SlotPool(64, 1), FakeVocab(), 64)
    sched.add(request("e", "eve", GRAMMAR))
    plan = sched.schedule()
    for _ in range(100):
        shares.charge(plan, StepOutput({}, decode_s=DECODE_S, grammar_s={0: 1.0}))
    assert shares.waits("eve") and shares.debt["eve"] <= 2.0
    steps = 0
    while shares.waits("eve"):
        shares.charge(plan, StepOutput({}, decode_s=DECODE_S))
        steps += 1
    assert steps == pytest.approx((2.0 - GRAMMAR_BURST_S) / (GRAMMAR_SHARE * DECODE_S), abs=2)
    assert not shares.waits("bob")


def test_a_grammar_ended_as_too_costly_is_refused_when_the_same_key_sends_it_again():
    sched = Scheduler(SlotPool(128, 2), FakeVocab(), 64)
    sched.add(request("first", "eve", GRAMMAR, n=100))
    runner = ScriptedRunner({"first": [5] * 100})
    plan = sched.schedule()
    out = runner.decode(plan)
    out.costly_grammars = frozenset({plan.chunks[0].slot_id})
    (req, event), = sched.update(plan, out)[-1:]
    assert event.finish_reason is FinishReason.GRAMMAR_COST
    with pytest.raises(GrammarRefused, match="too costly"):
        sched.add(request("again", "eve", GRAMMAR))
    sched.add(request("other key", "bob", GRAMMAR))  # another key's is its own
    sched.add(request("other grammar", "eve", 'root ::= "b"'))


def test_the_memory_of_costly_grammars_expires_and_is_bounded():
    memory = CostlyGrammars(memory_s=60)
    memory.ended("eve", GRAMMAR, now=100.0)
    with pytest.raises(GrammarRefused):
        memory.check("eve", GRAMMAR, now=159.0)
    memory.check("eve", GRAMMAR, now=160.0)  # expired: accepted, and forgotten
    memory.check("eve", None, now=0.0)
    memory.ended("eve", GRAMMAR, now=200.0)
    with pytest.raises(GrammarRefused, match="30 s ago .* for 30 s more"):
        memory.check("eve", GRAMMAR, now=230.0)
    for i in range(1023):
        memory.ended("eve", f"g{i}", now=1.0)
    memory.ended("eve", GRAMMAR, now=240.0)  # ended again: the most recent now
    memory.ended("eve", "g1023", now=1.0)  # one past the bound: the least recent goes
    assert memory.refusal("eve", "g0", now=2.0) is None
    assert memory.refusal("eve", GRAMMAR, now=241.0) and memory.refusal("eve", "g1", now=2.0)
    for i in range(2000):
        memory.ended("eve", f"g{i}", now=1.0)
    assert len(memory._ended) == 1024


def test_charges_are_exact_per_user_and_a_paid_debt_is_gone():
    from types import SimpleNamespace

    def chunk(slot_id, user):
        return SimpleNamespace(slot_id=slot_id, request=SimpleNamespace(user=user))

    plan = SimpleNamespace(chunks=[chunk(0, "eve"), chunk(1, "bob"), chunk(2, "eve")])
    shares = GrammarShares()
    shares.charge(plan, StepOutput({}, decode_s=0.02, grammar_s={0: 0.05, 2: 0.03}))
    assert shares.debt == {"eve": pytest.approx(0.08 - 0.01)} and "bob" not in shares.charged
    assert shares.charged["eve"] == pytest.approx(0.08)
    shares.charge(plan, StepOutput({}, decode_s=0.14))  # pays back exactly 0.07
    assert shares.debt == {}
    shares.debt["eve"] = GRAMMAR_BURST_S
    assert not shares.waits("eve")  # at the burst exactly, not over it
