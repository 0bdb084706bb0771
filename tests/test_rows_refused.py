"""Hardening round 7: whatever one request's rows cannot do inside a step (an image the runner
cannot place), only that request fails; the others in the same step are planned again and
answer as alone (the real loop thread, a fake runner with llama.cpp's sequences)."""

import threading

from localserve.engine.errors import RowsRefused
from localserve.engine.loop import EngineLoop
from localserve.engine.request import Request, SamplingParams
from localserve.engine.scheduler import Scheduler
from localserve.engine.slots import SlotPool

from fakes import FakeVocab, PositionalRunner


class RefusesOneRequest(PositionalRunner):
    """Refuses, before decoding anything, every step holding a row of request `refused`."""

    def __init__(self, refused: str):
        super().__init__(1024)
        self.refused = refused

    def decode(self, plan):
        bad = {c.slot_id: "a step reached an image this model cannot place"
               for c in plan.chunks if c.request.request_id == self.refused}
        if bad:
            raise RowsRefused(bad, [])
        return super().decode(plan)


def serve(requests, refused: str = "nobody") -> dict:
    loop = EngineLoop(Scheduler(SlotPool(1024, 3), FakeVocab(), 64), RefusesOneRequest(refused))
    got, done = {}, threading.Event()
    for r in requests:
        def emit(event, rid=r.request_id):
            tokens, _, _ = got.get(rid, ([], None, None))
            got[rid] = (tokens + list(event.token_ids), event.finish_reason, event.error)
            if event.finished and sum(1 for _, end, _ in got.values() if end) == len(requests):
                done.set()
        r.emit = emit
    loop.start()
    try:
        for r in requests:
            loop.submit(r)
        assert done.wait(30), got
    finally:
        loop.stop()
        loop.join(10)
    return got


def ask(rid: str, first: int) -> Request:
    return Request(list(range(first, first + 20)), SamplingParams(max_tokens=12, ignore_eos=True),
                   request_id=rid)


def test_one_requests_refused_rows_end_it_alone_and_the_others_answer_as_alone():
    alone = serve([ask("bob", 100), ask("carol", 200)])
    beside = serve([ask("bob", 100), ask("alice", 1), ask("carol", 200)], refused="alice")
    tokens, end, error = beside.pop("alice")
    assert (tokens, end.value, error) == ([], "error", "a step reached an image this model cannot place")
    assert beside == alone and all(len(tokens) == 12 for tokens, _, _ in alone.values())
