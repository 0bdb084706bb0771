"""One pool by default (issue 41), on the real model through the real server: the context
comes from the model (the embedded one was trained on 8,192 tokens), every slot is guaranteed
its share and one request may borrow past it; a borrower that a request within its guarantee
needs the cells of is saved to the prompt cache, and resumes by restoring with the same
greedy text."""

import threading

import httpx
import pytest

from conftest import running, wait_for
from counting_prompts import assert_certain, counting, is_counting


def complete(srv, prompt, max_tokens=24, **extra):
    return httpx.post(srv.url + "/v1/completions", timeout=900, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})


@pytest.fixture(scope="module")
def defaults():
    """`localserve up` with no -c and no -np."""
    with running("-t", "2", log_name="pool-defaults") as srv:
        yield srv


def test_the_context_comes_from_the_model_and_props_and_the_log_say_so(defaults):
    props = httpx.get(defaults.url + "/props", timeout=10).json()
    assert props["ctx_size"] == 8192 and props["n_slots"] == 6
    assert props["n_ctx_per_slot"] == 8192 and props["n_ctx_guaranteed"] == 1365
    assert props["context"]["n_ctx_train"] == 8192 and "trained" in props["context"]["why"]
    assert props["context"]["kv_bytes_per_token"] > 0
    log = defaults.log()
    assert "context: 8192 tokens, the model's trained context" in log
    assert "1365 guaranteed to each; one request may use up to 8192" in log


@pytest.mark.timeout(1200)  # thousands of prompt tokens on 2 cores: work, not a clock
def test_a_6000_token_prompt_is_answered_with_the_defaults(defaults):
    prompt = counting(1, 1220)  # about 6,150 tokens (5-6 a number: digits one by one)
    r = complete(defaults, prompt, max_tokens=8)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["usage"]["prompt_tokens"] > 6000
    assert is_counting(prompt, r.json()["choices"][0]["text"])


def test_a_prompt_past_the_models_context_names_that_bound(defaults):
    r = complete(defaults, counting(1, 2100), max_tokens=8)  # about 11,500 tokens
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    message = r.json()["error"]["message"]
    assert "8192" in message and "trained" in message and "slot" not in message


@pytest.mark.timeout(1200)  # thousands of prompt tokens on 2 cores: work, not a clock
def test_two_colleagues_with_3500_token_prompts_together_are_both_answered(defaults):
    prompts = [counting(1, 660), counting(5000, 560)]  # about 3,600 tokens each
    answers = [None, None]

    def ask(i):
        answers[i] = complete(defaults, prompts[i], max_tokens=16)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=900)
    for prompt, answer in zip(prompts, answers):
        assert answer.status_code == 200, answer.text[:300]
        assert answer.json()["usage"]["prompt_tokens"] > 3000
        assert is_counting(prompt, answer.json()["choices"][0]["text"])


@pytest.fixture(scope="module")
def small_pool():
    """A pool of 4,096 tokens for 2 slots: 2,048 guaranteed to each."""
    with running("-c", "4096", "-np", "2", "-t", "2", "--spec", "off", log_name="pool-small") as srv:
        yield srv


@pytest.mark.timeout(1200)  # thousands of prompt tokens on 2 cores: work, not a clock
def test_a_borrower_gives_cells_back_to_a_request_within_its_guarantee_and_resumes_from_ram(small_pool):
    borrower, newcomer = counting(1, 540), counting(7000, 290)  # ~2,900 and ~1,900 tokens
    reference = complete(small_pool, borrower, max_tokens=120, logprobs=2).json()["choices"][0]
    assert_certain(borrower, reference["logprobs"]["top_logprobs"])
    alone = reference["text"]
    assert is_counting(borrower, alone)
    streamed, done = [], {}

    def stream_borrower():
        with httpx.stream("POST", small_pool.url + "/v1/completions", timeout=900, json={
                "prompt": borrower, "max_tokens": 120, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed.append(line)
        done["borrower"] = True

    # a different prompt first, so the borrower's own prefix is not simply kept in its slot
    complete(small_pool, counting(300, 200), max_tokens=4)
    reader = threading.Thread(target=stream_borrower)
    reader.start()
    wait_for(lambda: len(streamed) > 2, timeout=600, what="the borrower to decode")
    second = complete(small_pool, newcomer, max_tokens=8)
    reader.join(timeout=900)
    assert second.status_code == 200, second.text[:300]
    assert is_counting(newcomer, second.json()["choices"][0]["text"])
    import json
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in streamed
                   if json.loads(line[6:])["choices"])
    assert text == alone  # the same greedy text after preemption and restore
    snap = small_pool.slots()
    assert snap["engine"]["borrow_preemptions"] >= 1
    assert snap["cache"]["ram"]["tokens_restored"] > 2000  # restored, not recomputed
