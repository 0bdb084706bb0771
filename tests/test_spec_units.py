"""Pure tests of n-gram speculative decoding: the drafter's proposals, and the scheduler's
acceptance rule with a fake model (a rejected draft never reaches the client, the cache keeps
only what held, the output is exactly what one token a step gives)."""

import dataclasses

from localserve.engine.drafts import MAX_DRAFT, NgramDrafter
from localserve.engine.plan import StepOutput
from localserve.engine.scheduler import Scheduler
from localserve.engine.slots import SlotPool

from fakes import EOS, FakeVocab, ScriptedRunner, req, run


def test_the_drafter_proposes_what_followed_the_latest_ngram_last_time():
    drafter = NgramDrafter()
    text = [5, 6, 7, 8, 9, 10, 11, 1, 2, 5, 6, 7]
    assert drafter.propose(text, 3) == [8, 9, 10]  # 5 6 7 was followed by 8 9 10
    assert drafter.propose(text + [42], 3) == []  # 6 7 42 never occurred
    drafter.feedback(3, 3)
    longer = text + [42, 5, 6, 7]  # the answer went on (tokens only ever grow)
    assert drafter.length == 8 and drafter.propose(longer, 100) == [42, 5, 6, 7]
    drafter.feedback(8, 2)
    assert drafter.length == 3
    drafter.feedback(3, 3)
    drafter.feedback(6, 6)
    assert drafter.length == MAX_DRAFT


class DraftingRunner(ScriptedRunner):
    """A deterministic 'model': the script is what it would sample at each position; a drafted
    chunk gets the drafts that match the script and the script's next token."""

    def decode(self, plan):
        self.batches.append([(c.slot_id, list(c.tokens), c.start_pos) for c in plan.chunks])
        sampled = {}
        for c in plan.chunks:
            if not c.sample:
                continue
            script, done = self.scripts[c.request.request_id], c.request.num_output_tokens
            if not c.drafts:
                sampled[c.slot_id] = script[done]
                continue
            out = []
            for k, draft in enumerate(c.tokens[-c.drafts:] + [None]):
                out.append(script[done + k])
                if out[-1] != draft:
                    break
            sampled[c.slot_id] = out
        return StepOutput(sampled)


def copy_case():
    """The prompt holds a passage; the answer copies it with one change: drafts hold, then
    one is rejected at the change, then hold again."""
    passage = list(range(30, 60))
    prompt = [1, 2, 3] + passage + [4]
    answer = passage[:12] + [99] + passage[13:] + [EOS]
    return prompt, answer


def test_drafts_give_exactly_the_scripted_output_in_fewer_steps():
    prompt, answer = copy_case()
    results = {}
    for speculative in (False, True):
        sched = Scheduler(SlotPool(256, 1), FakeVocab(), 64, speculative=speculative)
        request = req("copy", 0)
        request.prompt_tokens = list(prompt)
        runner = DraftingRunner({"copy": answer})
        sched.add(request)
        out, steps = run(sched, runner)
        slot = sched.pool.slots[0]
        results[speculative] = (out["copy"], request.output_tokens, steps, list(slot.cached))
        if speculative:
            assert sched.stats.draft_tokens > sched.stats.draft_tokens_accepted > 20
    plain, fast = results[False], results[True]
    assert fast[:2] == plain[:2] and fast[1] == answer  # the same text and tokens
    assert fast[2] < plain[2] / 2  # in less than half the steps
    assert fast[3] == plain[3] == prompt + answer[:-1]  # the cache holds what was kept, no more


def test_a_stop_inside_accepted_drafts_ends_there():
    prompt, answer = copy_case()
    sched = Scheduler(SlotPool(256, 1), FakeVocab(), 64, speculative=True)
    request = req("short", 0, max_tokens=7)
    request.prompt_tokens = list(prompt)
    sched.add(request)
    out, _ = run(sched, DraftingRunner({"short": answer}))
    assert request.output_tokens == answer[:7] and out["short"][1].value == "length"


def test_no_drafts_for_requests_that_want_logprobs_or_when_the_budget_is_spent():
    prompt, answer = copy_case()
    sched = Scheduler(SlotPool(256, 1), FakeVocab(), 64, speculative=True)
    request = req("lp", 0)
    request.prompt_tokens = list(prompt)
    request.params = dataclasses.replace(request.params, logprobs=2)
    sched.add(request)
    run(sched, DraftingRunner({"lp": answer}))
    assert sched.stats.draft_tokens == 0
    tight = Scheduler(SlotPool(256, 1), FakeVocab(), 1, speculative=True)  # one token a step
    request = req("tight", 0)
    request.prompt_tokens = list(prompt)
    tight.add(request)
    run(tight, DraftingRunner({"tight": answer}), steps=200)
    assert tight.stats.draft_tokens == 0
