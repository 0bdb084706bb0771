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
    # --spec off: these tests compare greedy text across servers token for token, and a
    # drafted step batches differently (docs/flags.md, speculative decoding)
    with running("-c", "2048", "-np", "2", "-t", "2", "--spec", "off", *KEYS,
                 log_name="ramcache") as srv:
        yield srv


def test_a_conversation_pushed_out_of_the_slots_is_restored_with_the_same_text(cached):
    """Restoring is exactly what a slot that had kept the conversation would do: the same
    cached tokens, the same greedy text. (Computing the last prompt token alone rather than
    in a batch can itself change a greedy answer of this small model: llama.cpp's kernels
    differ by batch size, so the reference is the slot's own reuse, not a cold start.)"""
    with running("-c", "2048", "-np", "2", "-t", "2", "--cache-ram", "0", "--spec", "off",
                 *KEYS, log_name="nocache") as plain:
        cold, _ = ask(plain, 1)
        kept_by_slot, usage = ask(plain, 1)
        reused = usage["prompt_tokens_details"]["cached_tokens"]
        push_out_of_slots(plain)
        recomputed, usage = ask(plain, 1)
        assert usage["prompt_tokens_details"]["cached_tokens"] < 16  # no tier: computed again
        assert recomputed == cold
    assert ask(cached, 1)[0] == cold
    push_out_of_slots(cached)
    restored, usage = ask(cached, 1)
    assert restored == kept_by_slot
    assert usage["prompt_tokens_details"]["cached_tokens"] == reused == usage["prompt_tokens"] - 1
    assert metric(cached, "localserve:prompt_cache_hits_total") >= 1
    assert metric(cached, "localserve:prompt_cache_tokens_restored_total") >= reused


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


def test_conversations_survive_a_restart_through_the_disk_tier_and_bad_files_are_skipped(tmp_path):
    state = tmp_path / "state"
    args = ("-c", "2048", "-np", "2", "-t", "2", "--cache-disk", "200", "--state-dir", str(state),
            "--spec", "off")  # the same batch shapes in both runs: see docs/flags.md, drafts
    with running(*args, log_name="disk1") as srv:
        cold = {doc: ask(srv, doc)[0] for doc in (3, 4, 5)}
        answers = {doc: ask(srv, doc)[0] for doc in (3, 4, 5)}  # each from a slot or RAM
    folder = next((state / "prompt-cache").iterdir())
    assert len(list(folder.glob("*.cache"))) >= 3  # a conversation with two answers: two
    assert folder.stat().st_mode & 0o777 == 0o700
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in folder.glob("*.cache"))
    with running(*args, log_name="disk2") as srv:
        after, usage = ask(srv, 3)  # the first request after a restart
    # restored from disk: its text is an answer, not always answers[3] to the last bit (in one
    # pool the cells' layout differs from the first run's: README, One pool)
    assert after.strip()
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 16
    truncated, corrupted = sorted(folder.glob("*.cache"))[:2]
    truncated.write_bytes(truncated.read_bytes()[:-1000])
    raw = bytearray(corrupted.read_bytes())
    raw[-1] ^= 0xFF
    corrupted.write_bytes(bytes(raw))
    (folder / "foreign.cache").write_bytes(b"\x00not a cache file")
    with running(*args, log_name="disk3") as srv:
        for doc in (3, 4, 5):  # restored, or computed again where its file was bad
            assert ask(srv, doc)[0].strip()
        log = srv.log()
    assert "skipped and deleted foreign.cache" in log
    assert f"skipped and deleted {truncated.name}: truncated" in log
    assert f"skipped and deleted {corrupted.name}: corrupted" in log
