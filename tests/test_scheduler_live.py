"""Scheduler depth on the real model: preemption in a small shared pool, prefix caching,
queue overflow."""

import asyncio
import json

import httpx
import pytest

from conftest import running
from counting_prompts import assert_certain, is_counting

SYSTEM = ("You are the help desk of a small architecture office. Answer briefly and politely. "
          "The office opens at nine and closes at five. The printer is on the second floor. "
          "Meeting rooms are booked through the shared calendar. ") * 6


@pytest.fixture(scope="module")
def tight_server():
    """One pool of 512 tokens for 4 slots: too small for 4 x (~10 + 150) tokens."""
    with running("-c", "512", "-np", "4", "-t", "2", log_name="tight") as srv:
        yield srv


# Counting prompts (counting_prompts.py): certain enough that the float noise of a shared
# cache cannot flip a greedy choice, while a lost or repeated token would break the count.
PROMPTS = ["1, 2, 3, 4, 5,", "10, 11, 12, 13,", "500, 501, 502, 503,", "20, 21, 22, 23,"]


async def complete(url, prompt, stream=False):
    """The greedy text; not streamed, it is the reference, whose certainty is asserted."""
    body = {"prompt": prompt, "max_tokens": 150, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    async with httpx.AsyncClient(timeout=300) as client:
        if not stream:
            r = await client.post(url + "/v1/completions", json={**body, "logprobs": 2})
            r.raise_for_status()
            choice = r.json()["choices"][0]
            assert_certain(prompt, choice["logprobs"]["top_logprobs"])
            return choice["text"]
        text = ""
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text


def test_small_pool_preempts_yet_every_greedy_stream_is_unchanged(tight_server):
    url = tight_server.url
    alone = [asyncio.run(complete(url, p)) for p in PROMPTS]
    assert tight_server.slots()["engine"]["preemptions"] == 0
    assert all(is_counting(p, t) for p, t in zip(PROMPTS, alone))

    async def together():
        return await asyncio.gather(*(complete(url, p, stream=True) for p in PROMPTS))

    crowded = asyncio.run(together())
    snap = tight_server.slots()
    assert snap["engine"]["preemptions"] > 0
    assert crowded == alone
    assert all(s["state"] == "idle" for s in snap["slots"]) and snap["queue"]["waiting"] == 0
    log = tight_server.log()
    assert "preempted req-" in log and "cache pool of 512 tokens" in log
    assert "sharing one cache pool of 512 tokens" in log


def test_shared_system_prompt_is_served_from_the_prefix_cache(server, client):
    def ask(question):
        return client.chat.completions.create(
            model="default", max_tokens=8, temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])

    computed_before = server.slots()["engine"]["prompt_tokens_computed"]
    first = ask("Where is the printer?")
    computed_mid = server.slots()["engine"]["prompt_tokens_computed"]
    second = ask("When does the office open?")
    computed_after = server.slots()["engine"]["prompt_tokens_computed"]
    assert first.usage.prompt_tokens > 250
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 20
    assert computed_after - computed_mid == second.usage.prompt_tokens - cached
    assert computed_after - computed_mid < (computed_mid - computed_before) / 4
    snap = server.slots()["engine"]
    assert snap["prefix_cache_hits"] >= cached


@pytest.fixture(scope="module")
def one_slot_server():
    with running("-c", "1024", "-np", "1", "--max-queue", "2", "-t", "2", log_name="queue") as srv:
        yield srv


def test_queue_overflow_gets_503_with_retry_after_and_serving_goes_on(one_slot_server):
    url = one_slot_server.url

    async def burst():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(client.post(url + "/v1/completions", json={
                "prompt": f"Count to ten, take {i}:", "max_tokens": 40, "ignore_eos": True})
                for i in range(8)))

    replies = asyncio.run(burst())
    codes = sorted(r.status_code for r in replies)
    refused = [r for r in replies if r.status_code == 503]
    assert set(codes) == {200, 503} and len(refused) >= 4
    assert all(r.headers["retry-after"] and r.json()["error"]["code"] == "queue_full"
               for r in refused)
    assert all(r.json()["usage"]["completion_tokens"] == 40 for r in replies if r.status_code == 200)
    after = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
    assert after.status_code == 200
    snap = one_slot_server.slots()
    assert snap["queue"]["waiting"] == 0 and snap["slots"][0]["state"] == "idle"


def test_back_to_back_chats_cannot_stall_a_colleagues_long_prompt():
    """Hardening round 7, case 2: bob sends a short chat every step (as from three connections)
    while alice's 2,500-token prompt computes; each may stop a step of hers or start beside it.
    Her prompt keeps a floor of progress: done within twice its steps alone, not ~40x."""
    from localserve.engine.request import Request, SamplingParams
    from localserve.engine.scheduler import Scheduler
    from localserve.engine.slots import SlotPool

    from fakes import FakeVocab, PositionalRunner

    def steps_until_answered(with_bob: bool) -> int:
        sched = Scheduler(SlotPool(8192, 4, n_ctx_per_slot=8192), FakeVocab(), 256, prefill_budget=1024)
        runner = PositionalRunner(8192)
        alice = Request(list(range(1, 2501)), SamplingParams(max_tokens=1), request_id="alice",
                        user="alice")
        sched.add(alice)
        for step in range(1, 1000):
            bob = Request(list(range(3000 + 8 * step, 3008 + 8 * step)),
                          SamplingParams(max_tokens=1), request_id=f"bob{step}", user="bob")
            plan = sched.schedule()
            if with_bob and plan.stop_rule.stops(bob):
                sched.interrupted(plan, [])
            else:
                sched.update(plan, runner.decode(plan))
            if alice.finish_reason is not None:
                return step
            if with_bob:
                sched.add(bob)
        raise AssertionError("alice was never answered")

    alone = steps_until_answered(False)
    assert steps_until_answered(True) <= 2 * alone + 8, alone
