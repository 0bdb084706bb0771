"""A second real model (Gemma 3 270M, from scripts/setup-second-model) in its family's own chat
format: it serves a tool round trip end to end. This GGUF carries no template, so the server
picks the built-in Gemma one by architecture (and says so); with the family's real template
(tests/templates/google-gemma-2-2b-it.jinja), which has no tool syntax and no tool role (its
turns must alternate), tools use the generic format and a tool's result becomes the user's turn."""

import json
from pathlib import Path

import httpx
import pytest

from conftest import running

GEMMA = Path(__file__).resolve().parent.parent / "models" / "gemma-3-270m-q4_k_m.gguf"
pytestmark = pytest.mark.skipif(not GEMMA.is_file(), reason="no Gemma 3 270M: scripts/setup-second-model")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"]}}}


TEMPLATE = Path(__file__).resolve().parent / "templates" / "google-gemma-2-2b-it.jinja"


@pytest.fixture(scope="module")
def gemma():
    with running("-m", str(GEMMA), "-c", "2048", "-np", "2", "-t", "2", "--chat-template-file",
                 str(TEMPLATE), log_name="gemma") as srv:
        yield srv


def chat(srv, messages, **extra):
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=180, json={
        "messages": messages, "tools": [WEATHER], "temperature": 0, "max_tokens": 60, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_gemma_serves_a_tool_round_trip_with_its_own_template(gemma):
    props = httpx.get(gemma.url + "/props").json()
    assert "<start_of_turn>" in props["chat_template"] and props["model_path"].endswith(".gguf")
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = chat(gemma, question, tool_choice="required", parallel_tool_calls=False)
    assert first["finish_reason"] == "tool_calls"
    call = first["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])
    history = question + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C"}]
    second = chat(gemma, history, tool_choice="none")  # no tool role in Gemma: a user turn
    assert second["message"]["content"] and second["finish_reason"] in ("stop", "length")
    shown = httpx.post(gemma.url + "/apply-template", json={"messages": history})
    assert shown.status_code == 400  # rendered as sent, Gemma's template refuses a tool role...
    # ...which is why the chat route writes the result as the user's turn


def test_a_gguf_without_a_template_gets_its_familys_turns_and_the_log_says_so():
    with running("-m", str(GEMMA), "-c", "1024", "-np", "1", "-t", "2", log_name="gemma-bare") as srv:
        assert "<start_of_turn>" in httpx.get(srv.url + "/props").json()["chat_template"]
        assert "carries no chat template: using the built-in gemma format" in srv.log()


def test_system_text_and_tool_results_become_user_turns_that_alternate():
    from localserve.models.chat_template import as_alternating_turns

    turns = as_alternating_turns([
        {"role": "system", "content": "Tools: ..."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "{...}"},
        {"role": "tool", "content": "Sunny"}, {"role": "tool", "content": "21 C"}])
    assert [t["role"] for t in turns] == ["user", "assistant", "user"]
    assert turns[0]["content"] == "Tools: ...\n\nWeather?"
    assert turns[2]["content"] == "Tool result: Sunny\n\nTool result: 21 C"
