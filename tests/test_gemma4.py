"""Gemma 4's answers (api/gemma4.py) read as llama.cpp reads them: the canned outputs and
expectations of llama.cpp's tests/test-chat.cpp (its Gemma 4 block), whole and streamed in
small pieces; on the real server, the embedded model with Gemma 4's own template is shown its
tools in Gemma's words, and a forced call, written in Gemma's dictionary syntax with each value
typed by its schema, comes back as tool calls."""

import json
from pathlib import Path

import httpx
import pytest

from answer_vectors import check
from conftest import running
from localserve.api.gemma4 import GemmaReader

TEMPLATE = Path(__file__).parent / "templates" / "google-gemma-4-31B-it.jinja"
ANSWER, THOUGHT = "Hello, world!\nWhat's up?", "I'm\nthinking"
Q = '<|"|>'
VECTORS = [  # (the model's answer, expected reasoning, content, calls): test-chat.cpp's
    ("Hello, world!", "", "Hello, world!", []),
    ("<|channel>thought\nI'm\nthinking<channel|>" + ANSWER, THOUGHT, ANSWER, []),
    ("<|channel>thought<channel|>" + ANSWER, "", ANSWER, []),
    (f"<|tool_call>call:get_time{{city:{Q}London{Q}}}<tool_call|>", "", "",
     [("get_time", {"city": "London"})]),
    (f"<|tool_call>call:get_time{{city:{Q}San Francisco{Q}}}<tool_call|>", "", "",
     [("get_time", {"city": "San Francisco"})]),
    ("<|tool_call>call:empty_args{}<tool_call|>", "", "", [("empty_args", {})]),
    (f"{ANSWER}<|tool_call>call:get_time{{city:{Q}Paris{Q}}}<tool_call|>", "", ANSWER,
     [("get_time", {"city": "Paris"})]),
    (f"<|channel>thought\nI'm\nthinking<channel|><|tool_call>call:get_time{{city:{Q}Paris{Q}}}"
     "<tool_call|>", THOUGHT, "", [("get_time", {"city": "Paris"})]),
    (f"<|tool_call>call:get_time{{city:{Q}London{Q}}}<tool_call|><|tool_call>call:get_weather"
     f"{{city:{Q}Paris{Q}}}<tool_call|>", "", "",
     [("get_time", {"city": "London"}), ("get_weather", {"city": "Paris"})]),
    ("<|tool_call>call:special_function{arg1:42}<tool_call|>", "", "",
     [("special_function", {"arg1": 42})]),
    ("<|tool_call>call:special_function{arg1:-7}<tool_call|>", "", "",
     [("special_function", {"arg1": -7})]),
    ("<|tool_call>call:amount{orig:3.14}<tool_call|>", "", "", [("amount", {"orig": 3.14})]),
    ("<|tool_call>call:toggle{enabled:true}<tool_call|>", "", "", [("toggle", {"enabled": True})]),
    ("<|tool_call>call:toggle{enabled:false}<tool_call|>", "", "",
     [("toggle", {"enabled": False})]),
    ("<|tool_call>call:set_nullable{value:null}<tool_call|>", "", "",
     [("set_nullable", {"value": None})]),
    (f"<|tool_call>call:todo_list{{todos:[{Q}buy milk{Q},{Q}walk dog{Q}]}}<tool_call|>", "", "",
     [("todo_list", {"todos": ["buy milk", "walk dog"]})]),
    (f"<|tool_call>call:set_config{{config:{{theme:{Q}dark{Q},count:3}}}}<tool_call|>", "", "",
     [("set_config", {"config": {"theme": "dark", "count": 3}})]),
    ("<|tool_call>call:todo_list{todos:[]}<tool_call|>", "", "", [("todo_list", {"todos": []})]),
    ("<|tool_call>call:set_config{config:{}}<tool_call|>", "", "",
     [("set_config", {"config": {}})]),
    ("<|tool_call>call:amount{orig:1.5e10}<tool_call|>", "", "", [("amount", {"orig": 1.5e10})]),
    ("<|channel>thought\n<channel|>" + ANSWER + "<channel|>", "", ANSWER, []),
    ("<|channel>thought\n<channel|>" + ANSWER + "<|channel>thought\n<channel|>", "", ANSWER, []),
    ("<|channel>thought\n<channel|>" + ANSWER + "<|channel>thought\n<channel|><channel|>", "",
     ANSWER, []),
    ("<|channel><|channel>thought\n<channel|>" + ANSWER, "", ANSWER, []),
]


@pytest.mark.parametrize("answer, thought, content, calls", VECTORS)
def test_llama_cpps_gemma4_vectors_whole_and_streamed(answer, thought, content, calls):
    check(GemmaReader, answer, (thought, content, calls))


@pytest.fixture(scope="module")
def gemma4():
    with running("-c", "2048", "-np", "1", "-t", "2", "--chat-template-file", str(TEMPLATE),
                 log_name="gemma4") as srv:
        yield srv


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "maxLength": 24}, "days": {"type": "integer"}}}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]


def test_apply_template_shows_the_tools_and_history_in_gemmas_words(gemma4):
    r = httpx.post(gemma4.url + "/apply-template", json={"messages": HISTORY,
                                                        "tools": [WEATHER]}, timeout=60)
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    assert "<|tool>declaration:get_weather" in prompt and "Current weather of a city" in prompt
    assert "<|tool_call>call:get_weather{city:" in prompt and "Sunny, 21 C" in prompt


def test_a_forced_call_is_written_in_gemmas_syntax_and_read_back(gemma4):
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = httpx.post(gemma4.url + "/v1/chat/completions", timeout=120, json={
            "messages": QUESTION, "tools": [WEATHER], "tool_choice": tool_choice,
            "max_tokens": 80, "temperature": 0, "parallel_tool_calls": False})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        [call] = choice["message"]["tool_calls"]
        arguments = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] == "get_weather" and set(arguments) <= {"city", "days"}
        assert 0 <= len(arguments["city"]) <= 24 and isinstance(arguments.get("days", 0), int)
    anthropic = httpx.post(gemma4.url + "/v1/messages", timeout=120, json={
        "model": "m", "max_tokens": 80, "messages": QUESTION, "temperature": 0,
        "tool_choice": {"type": "any"},
        "tools": [{"name": "get_weather", "description": "Current weather of a city",
                   "input_schema": WEATHER["function"]["parameters"]}]}).json()
    uses = [b for b in anthropic["content"] if b["type"] == "tool_use"]
    assert uses and all(u["name"] == "get_weather" and "city" in u["input"] for u in uses)
