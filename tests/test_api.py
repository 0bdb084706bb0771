"""The OpenAI API on the real model through the real server, with the official openai client."""

import re

import httpx
import openai
import pytest

QUESTION = [{"role": "user", "content": "What is 2+2?"}]


def test_health_models_and_slots_show_the_split(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1"]
    slots = server.slots()
    assert slots["n_slots"] == 4 and slots["n_ctx_per_slot"] == 4096 and slots["ctx_size"] == 4096
    assert slots["n_ctx_guaranteed"] == 1024
    said = "4 slots sharing one cache pool of 4096 tokens, 1024 guaranteed to each"
    assert said in slots["split"] and said in server.log()
    assert all(s["n_guaranteed"] == 1024 and s["n_borrowed"] == 0 for s in slots["slots"])
    assert {s["state"] for s in slots["slots"]} <= {"idle", "prefill", "decode"}


def test_chat_completion(client):
    reply = client.chat.completions.create(model="default", messages=QUESTION, temperature=0,
                                           max_tokens=40)
    text = reply.choices[0].message.content
    assert "4" in text
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 5 and 0 < reply.usage.completion_tokens <= 40
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_stream_matches_non_stream_and_reports_usage(client):
    whole = client.chat.completions.create(messages=QUESTION, model="default", temperature=0,
                                           max_tokens=30)
    chunks = list(client.chat.completions.create(
        messages=QUESTION, model="default", temperature=0, max_tokens=30, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stream_ends_with_done(server):
    body = {"messages": QUESTION, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"


def test_text_completion_stream_and_not(client):
    kwargs = dict(model="default", prompt="The three primary colors are", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    assert whole.choices[0].text == streamed and len(streamed) > 0
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12


def test_max_tokens_and_stop_string(client):
    reply = client.completions.create(model="default", prompt="1, 2, 3, 4,", max_tokens=30,
                                      temperature=0, stop=["7"], extra_body={"ignore_eos": True})
    text = reply.choices[0].text
    assert "7" not in text and reply.choices[0].finish_reason == "stop"
    assert "6" in text


def test_prompt_too_long_is_refused_with_the_numbers(client, server):
    long_prompt = "hello " * 4500
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="default", prompt=long_prompt, max_tokens=5)
    err = info.value.body
    assert err["code"] == "context_length_exceeded"
    assert "the whole cache pool, 4096 tokens" in err["message"] and "raise -c" in err["message"]
    n_prompt = int(re.search(r"prompt is (\d+) tokens", err["message"]).group(1))
    assert n_prompt >= 4500
    assert all(s["state"] == "idle" for s in server.slots()["slots"])


def test_context_limit_ends_with_length(client):
    prompt = "word " * 4000  # about 4000 tokens of the 4096 one request may use
    reply = client.completions.create(model="default", prompt=prompt, max_tokens=500, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens <= 4096
    assert reply.usage.completion_tokens < 500


@pytest.mark.parametrize("body, status, fragment", [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({"messages": QUESTION, "temperature": 7}, 400, "temperature"),
    ({"messages": QUESTION, "max_tokens": -3}, 400, "max_tokens"),
    ({"messages": QUESTION, "n": 99}, 400, "n"),
    ({}, 400, "messages"),
])
def test_bad_input_gets_openai_error(server, body, status, fragment):
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert fragment in error["message"] and error["type"]


def test_malformed_json_is_400(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "error" in r.json()
