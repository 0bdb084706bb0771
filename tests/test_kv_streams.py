"""A cache stream per slot (--no-kv-unified: llama-server's cache at an explicit -np), on the
real model through the real server: each slot holds -c / -np tokens of its own and borrows
nothing, a colleague's rows never share a slot's cells, so a greedy answer is the same text
alone and beside colleagues; follow-ups and siblings (a whole stream copied) still work."""

import asyncio

import httpx
import pytest

from conftest import running

PROBE = "Write three sentences about the sea."


def complete(srv, prompt, max_tokens=32, **extra):
    return httpx.post(srv.url + "/v1/completions", timeout=600, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})


@pytest.fixture(scope="module")
def wide():
    """Eight streams of 512 tokens: a probe and seven colleagues at once."""
    with running("-t", "2", "-c", "4096", "-np", "8", "--no-kv-unified",
                 log_name="kv-streams-8") as srv:
        yield srv


@pytest.fixture(scope="module")
def streams():
    with running("-t", "2", "-c", "2048", "-np", "4", "--no-kv-unified",
                 log_name="kv-streams") as srv:
        yield srv


def test_props_and_the_log_say_each_slot_has_its_own_stream(streams):
    props = httpx.get(streams.url + "/props", timeout=10).json()
    assert props["kv_unified"] is False and props["n_slots"] == 4
    assert props["n_ctx_per_slot"] == 512 and props["n_ctx_guaranteed"] == 512
    assert "4 slots, each with a cache stream of its own 512 tokens" in streams.log()


def test_a_prompt_past_its_slots_stream_is_refused_naming_the_bound(streams):
    r = complete(streams, "one two three four five six seven " * 90)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "512" in r.json()["error"]["message"]


PROBES = ("The capital of France is", "Write a short poem about the sea.",
          "List three uses of a paperclip.", "Explain what a cache is, in two sentences.")


async def ask(client, url, content, greedy, seed=0):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 48 if greedy else 96}
    body.update({"temperature": 0} if greedy else {"temperature": 1.0, "seed": seed})
    r = await client.post(url + "/v1/chat/completions", json=body)
    return r.json()["choices"][0]["message"]["content"]


async def beside(url, probe, n, seed):
    """The probe's greedy text, sent at once with n colleagues' sampled requests (as
    `bench/run greedy --beside` sends them)."""
    async with httpx.AsyncClient(timeout=600) as client:
        answers = await asyncio.gather(ask(client, url, probe, True), *[
            ask(client, url, f"Tell colleague {i} a story about room {seed + i}.", False, seed + i)
            for i in range(n)])
    return answers[0]


@pytest.mark.timeout(900)
def test_a_greedy_answer_is_the_same_alone_and_beside_colleagues(wide):
    """The measurement behind the flag: in one pool these probes part from their text alone
    in about half the runs beside others (docs/performance.md)."""
    for probe in PROBES:
        alone = [asyncio.run(beside(wide.url, probe, 0, 0)) for _ in range(2)][-1]
        assert [asyncio.run(beside(wide.url, probe, n, 10 * n)) for n in (3, 7)] == [alone] * 2


def test_a_follow_up_reuses_its_slot_and_siblings_share_the_prompt(streams):
    story = "The harbour town woke slowly. " * 12 + PROBE
    first = complete(streams, story, max_tokens=8).json()
    follow = complete(streams, story + first["choices"][0]["text"] + " And more:", max_tokens=8)
    assert follow.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 60
    r = complete(streams, "List three colours:", max_tokens=12, n=2, temperature=1.0, seed=3)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert all(c["text"] for c in r.json()["choices"])
