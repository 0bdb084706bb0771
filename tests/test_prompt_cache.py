"""The prompt cache beyond the slots (--cache-ram), on the real model: a conversation pushed out
of every slot comes back from RAM with the same greedy text as one computed from scratch,
never for another key, and the cache stays inside its byte bound."""

from __future__ import annotations

import httpx
import pytest

from conftest import running

KEYS = ("--api-key", "alice-key-0123456789", "--api-key", "bob-key-0123456789")


def document(i: int) -> str:
    """A distinct ~250-token document per colleague."""
    return " ".join(f"Item {i}-{j}: the {['red', 'blue', 'green'][j % 3]} box holds {i * j} coins."
                    for j in range(25))


def ask(srv, doc: int, key: str = "alice-key-0123456789", question: str = "What is in item 3?"):
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                   headers={"Authorization": f"Bearer {key}"},
                   json={"messages": [{"role": "system", "content": document(doc)},
                                      {"role": "user", "content": question}],
                         "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]


def push_out_of_slots(srv, first_doc: int = 10) -> None:
    for doc in range(first_doc, first_doc + 2):  # two slots: two other documents take them
        ask(srv, doc)


@pytest.fixture(scope="module")
def cached():
    with running("-c", "2048", "-np", "2", "-t", "2", *KEYS, log_name="ramcache") as srv:
        yield srv


def test_a_conversation_pushed_out_of_the_slots_is_restored_with_the_same_text(cached):
    with running("-c", "2048", "-np", "2", "-t", "2", "--cache-ram", "0", *KEYS,
                 log_name="nocache") as plain:
        reference, _ = ask(plain, 1)
        push_out_of_slots(plain)
        recomputed, usage = ask(plain, 1)
        assert usage["prompt_tokens_details"]["cached_tokens"] < 16  # no tier: computed again
    first, _ = ask(cached, 1)
    push_out_of_slots(cached)
    restored, usage = ask(cached, 1)
    assert first == reference == recomputed == restored
    # all of the document and question but the last token came back from RAM
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 16
    assert metric(cached, "localserve:prompt_cache_hits_total") >= 1
    assert metric(cached, "localserve:prompt_cache_tokens_restored_total") >= usage["prompt_tokens"] - 16


def metric(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10,
                     headers={"Authorization": "Bearer alice-key-0123456789"}).text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.split(" ")[0] == name)


def test_one_keys_cached_prompt_is_never_restored_for_another(cached):
    ask(cached, 2, key="alice-key-0123456789")
    push_out_of_slots(cached, first_doc=20)
    _, usage = ask(cached, 2, key="bob-key-0123456789")
    assert usage["prompt_tokens_details"]["cached_tokens"] < 16  # the template's first tokens
    _, usage = ask(cached, 2, key="alice-key-0123456789")  # still there for its owner
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_the_cache_stays_inside_its_byte_bound_under_a_flood_of_prompts():
    with running("-c", "2048", "-np", "2", "-t", "2", "--cache-ram", "20",
                 log_name="ramflood") as srv:
        for doc in range(40, 52):
            ask(srv, doc)
        assert metric(srv, "localserve:prompt_cache_bytes") <= 20 * 1024 * 1024
        assert metric(srv, "localserve:prompt_cache_evictions_total") >= 1
        assert metric(srv, "localserve:prompt_cache_saves_total") >= 3
