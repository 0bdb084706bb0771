"""Engine faults, injected in-process on the real model: a failed llama_decode, a crash in one
request's token handling, and the engine thread dying outright."""

import asyncio

import pytest
from fastapi.testclient import TestClient

from localserve.api.app import create_app
from localserve.common.config import Settings
from localserve.engine.request import Request, SamplingParams
from localserve.engine.errors import DecodeError
from localserve.models.model_host import ModelHost


def fresh_service(**kw) -> ModelHost:
    svc = ModelHost(Settings(ctx_size=1024, parallel=kw.pop("parallel", 1), threads=2, **kw))
    svc.load()
    assert svc.ready, svc.load_error
    return svc


async def run_all(service, requests):
    async def one(r):
        return [e async for e in service.engine.submit(r)]
    return await asyncio.gather(*(one(r) for r in requests))


def req(text, service, n=8):
    return Request(service.tokenize_prompt(text), SamplingParams(max_tokens=n, temperature=0,
                                                                 ignore_eos=True))


@pytest.fixture()
def service():
    svc = fresh_service()
    yield svc
    svc.stop()


def test_failed_decode_hits_only_its_batch_not_the_waiting_request(service, monkeypatch):
    real = service.runner.decode
    calls = {"n": 0}

    def failing_once(plan):
        calls["n"] += 1
        if calls["n"] == 3:
            raise DecodeError("injected: llama_decode returned -1")
        return real(plan)

    monkeypatch.setattr(service.runner, "decode", failing_once)
    first, second = req("First", service), req("Second", service)  # one slot: second waits
    events_first, events_second = asyncio.run(run_all(service, [first, second]))
    assert events_first[-1].finish_reason == "error" and "injected" in events_first[-1].error
    assert events_second[-1].finish_reason == "length" and events_second[-1].completion_tokens == 8
    assert service.ready


def test_crash_in_one_requests_detokenizing_ends_that_request_only():
    service = fresh_service(parallel=2)
    try:
        doomed, healthy = req("Doomed", service), req("Healthy", service)
        original_feed = None

        async def run():
            nonlocal original_feed
            s_doomed = service.engine.submit(doomed)
            s_healthy = service.engine.submit(healthy)
            first = await s_doomed.__anext__()  # doomed has a detokenizer now

            def boom(piece):
                raise UnicodeError("injected detokenizer crash")

            doomed.detokenizer.feed = boom
            rest = [e async for e in s_doomed]
            return [first] + rest, [e async for e in s_healthy]

        events_doomed, events_healthy = asyncio.run(run())
        assert events_doomed[-1].finish_reason == "error" and "injected" in events_doomed[-1].error
        assert events_healthy[-1].finish_reason == "length"
        assert "".join(e.text for e in events_healthy)
        assert service.ready and service.loop.is_alive()
    finally:
        service.stop()


def test_dead_engine_thread_shows_in_health_and_requests_fail_fast():
    service = fresh_service()
    try:
        def broken_schedule():
            raise RuntimeError("injected scheduler bug")

        service.loop.scheduler.schedule = broken_schedule
        client = TestClient(create_app(model_host=service), base_url="http://localhost")
        stuck = req("Anyone there?", service)

        async def submit():
            return [e async for e in service.engine.submit(stuck)]

        events = asyncio.run(asyncio.wait_for(submit(), timeout=10))
        assert events[-1].finish_reason == "error" and "engine loop died" in events[-1].error
        service.loop.join(timeout=5)
        health = client.get("/health")
        assert health.status_code == 503 and "injected scheduler bug" in health.json()["error"]
        r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
    finally:
        service.stop()
