"""A battery of broken requests: each gets a 4xx with an OpenAI-style error a person can read,
and afterwards the server still answers a normal request correctly."""

import httpx
import pytest

OK_MESSAGES = [{"role": "user", "content": "What is 2+2?"}]

CHAT_CASES = [
    ("malformed JSON", b'{"messages": [', 400, "JSON"),
    ("invalid UTF-8 bytes", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, ""),
    ("lone surrogate", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400, "surrogate"),
    ("body is a list", b"[1, 2, 3]", 400, ""),
    ("missing messages", {}, 400, "messages"),
    ("messages not a list", {"messages": "hello"}, 400, "messages"),
    ("empty messages", {"messages": []}, 400, "messages"),
    ("unknown role", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ("content wrong type", {"messages": [{"role": "user", "content": 42}]}, 400, "content"),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "content"),
    ("negative max_tokens", {"messages": OK_MESSAGES, "max_tokens": -5}, 400, "max_tokens"),
    ("zero max_tokens", {"messages": OK_MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    ("absurd max_tokens", {"messages": OK_MESSAGES, "max_tokens": 10**15}, 400, "max_tokens"),
    ("max_tokens as text", {"messages": OK_MESSAGES, "max_tokens": "lots"}, 400, "max_tokens"),
    ("temperature too high", {"messages": OK_MESSAGES, "temperature": 9}, 400, "temperature"),
    ("temperature negative", {"messages": OK_MESSAGES, "temperature": -1}, 400, "temperature"),
    ("top_p zero", {"messages": OK_MESSAGES, "top_p": 0}, 400, "top_p"),
    ("top_p above one", {"messages": OK_MESSAGES, "top_p": 1.5}, 400, "top_p"),
    ("n above the slots", {"messages": OK_MESSAGES, "n": 99}, 400, "n"),
    ("functions (not supported)", {"messages": OK_MESSAGES, "functions": [{"name": "f"}]}, 400,
     "functions"),
    ("logit_bias token out of range", {"messages": OK_MESSAGES, "logit_bias": {"999999": 5}},
     400, "logit_bias"),
    ("too many stops", {"messages": OK_MESSAGES, "stop": [str(i) for i in range(40)]}, 400, "stop"),
    ("stop not strings", {"messages": OK_MESSAGES, "stop": [1, 2]}, 400, "stop"),
    ("stream not bool", {"messages": OK_MESSAGES, "stream": "yes please"}, 400, "stream"),
    ("prompt exceeds the pool", {"messages": [{"role": "user", "content": "word " * 5000}]}, 400,
     "one request may use the whole cache pool, 4096 tokens"),
]

COMPLETION_CASES = [
    ("empty prompt", {"prompt": ""}, 400, "empty"),
    ("empty token list", {"prompt": []}, 400, "prompt"),
    ("token id out of range", {"prompt": [1, 2, 999999999]}, 400, "out of range"),
    ("several prompts", {"prompt": ["a", "b"]}, 400, "one prompt"),
]


def send(server, path, body):
    if isinstance(body, bytes):
        return httpx.post(server.url + path, content=body,
                          headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(server.url + path, json=body, timeout=60)


def check(response, status, fragment):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert len(error["message"]) > 10 and fragment.lower() in error["message"].lower()


@pytest.mark.parametrize("name, body, status, fragment", CHAT_CASES, ids=[c[0] for c in CHAT_CASES])
def test_chat_bad_input(server, name, body, status, fragment):
    check(send(server, "/v1/chat/completions", body), status, fragment)


@pytest.mark.parametrize("name, body, status, fragment", COMPLETION_CASES,
                         ids=[c[0] for c in COMPLETION_CASES])
def test_completion_bad_input(server, name, body, status, fragment):
    check(send(server, "/v1/completions", body), status, fragment)


def test_unknown_route_and_method_are_openai_errors(server):
    check(httpx.get(server.url + "/v1/nothing-here"), 404, "not found")
    check(httpx.get(server.url + "/v1/chat/completions"), 405, "method")


def test_server_still_answers_correctly_after_the_battery(server, client):
    for name, body, status, fragment in CHAT_CASES + COMPLETION_CASES:
        send(server, "/v1/chat/completions" if "messages" in str(body) else "/v1/completions", body)
    reply = client.chat.completions.create(model="default", messages=OK_MESSAGES, temperature=0,
                                           max_tokens=20)
    assert "4" in reply.choices[0].message.content
    assert server.slots()["engine"]["alive"]
