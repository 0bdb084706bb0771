"""Images are encoded off the engine thread, before their request is admitted (hardening round
7, case 5): the scheduler hands the images admission waits for to the runner (StepPlan.encodes:
its encoder's own thread), the request waits in the queue while colleagues step, and an image
whose rows a slot already holds is never encoded again. Pure: the fake runner of the scheduler
tests, images as objects with `ready` (runner/images.py ImageInput's)."""

from localserve.engine.image_rows import image_id
from localserve.engine.request import Request, SamplingParams
from localserve.engine.scheduler import Scheduler
from localserve.engine.slots import SlotPool
from fakes import FakeVocab, PositionalRunner, run_all

TEXT = list(range(1, 41))


class FakeImage:
    ready = False


def request(rid, prompt, max_tokens=20, **kw):
    return Request(list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   request_id=rid, **kw)


def with_image(h, after=(50, 51)):
    return [*TEXT, *(image_id(h, row, False) for row in range(8)), *after]


def step(sched, runner):
    plan = sched.schedule()
    sched.update(plan, runner.decode(plan))
    return plan


def test_a_request_waits_for_its_image_while_a_colleague_steps_then_is_admitted():
    sched = Scheduler(SlotPool(512, 2), FakeVocab(), max_num_batched_tokens=64)
    runner = PositionalRunner(512)
    image = FakeImage()
    sched.add(request("colleague", range(100, 110), max_tokens=40))
    sched.add(request("pictured", with_image(7), images={7: image}))
    asked = []
    for _ in range(5):
        plan = step(sched, runner)
        asked += plan.encodes
        assert "pictured" not in {c.request.request_id for c in plan.chunks}
        assert "colleague" in {c.request.request_id for c in plan.chunks}
    assert asked and all(a is image for a in asked)
    image.ready = True
    plan = step(sched, runner)
    assert [a.request.request_id for a in plan.admitted] == ["pictured"] and not plan.encodes


def test_an_image_whose_rows_a_slot_holds_is_not_encoded_again():
    sched = Scheduler(SlotPool(512, 1), FakeVocab(), max_num_batched_tokens=64)
    runner = PositionalRunner(512)
    first = FakeImage()
    first.ready = True
    out, _ = run_all(sched, runner, [request("turn 1", with_image(7), images={7: first})])
    again = FakeImage()  # the same image sent with the follow-up: a new object, not encoded
    follow_up = request("turn 2", with_image(7) + out["turn 1"] + [60, 61], images={7: again})
    sched.add(follow_up)
    plan = step(sched, runner)
    assert [a.request for a in plan.admitted] == [follow_up] and not plan.encodes
    assert plan.admitted[0].kept_tokens >= len(with_image(7))
