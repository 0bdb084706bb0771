"""A chat that arrives during a step of background tasks stops that step, on the real model
(runner/interrupt.py: llama.cpp's abort callback). The stopped step's cells are removed and the
step is made again: the task ends whole and nothing fails, with no llama.cpp warnings."""

import threading

import httpx
import pytest

from conftest import running, wait_for

TASK = ("### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat "
        "history.\n### Output:\nJSON format: { \"title\": \"your concise title here\" }\n"
        "### Chat History:\n<chat_history>\nUSER: How do I keep basil alive?\nASSISTANT: Sun, "
        "and water when the soil is dry.\n</chat_history>")


@pytest.fixture(scope="module")
def srv():
    with running("-c", "2048", "-np", "2", "-t", "2", "--task-max-tokens", "300",
                 log_name="interrupts") as server:
        yield server


def post(srv, content, **body):
    return httpx.post(srv.url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": content}], "temperature": 0, **body})


def test_chats_that_arrive_during_a_title_stop_its_steps_and_it_still_ends_whole(srv):
    before = srv.slots()["engine"]
    title = {}
    sender = threading.Thread(target=lambda: title.update(
        post(srv, TASK, ignore_eos=True).json()))  # no max_tokens: --task-max-tokens
    sender.start()
    wait_for(lambda: any(s["n_decoded"] > 0 for s in srv.slots()["slots"]), 120,
             "the title's first tokens")
    chats = []
    while sender.is_alive() and len(chats) < 200:  # one colleague's short chats meanwhile
        chats.append(post(srv, "Say hi.", max_tokens=1).status_code)
    sender.join(300)
    after = srv.slots()["engine"]
    assert title["usage"]["completion_tokens"] == 300
    assert title["choices"][0]["finish_reason"] == "length"
    assert set(chats) == {200}
    assert after["interrupted_steps"] > before["interrupted_steps"]
    assert after["requests_failed"] == before["requests_failed"]
    warnings = [line for line in srv.log().splitlines() if "WARNING localserve.llama" in line]
    assert warnings == []  # what llama.cpp says of a stopped step is expected: not passed on
