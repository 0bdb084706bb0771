"""gpt-oss's harmony answers (api/harmony.py) read as llama.cpp reads them: the canned outputs
and expectations of llama.cpp's tests/test-chat.cpp (its GPT-OSS block), whole and streamed in
small pieces; on the real server, the embedded model with gpt-oss's own template is prompted
with its tools in gpt-oss's words and its forced call, written in harmony form, comes back as
tool calls on the OpenAI, Anthropic and Ollama routes."""

import json
from pathlib import Path

import httpx
import pytest

from answer_vectors import check
from conftest import running
from localserve.api.harmony import HarmonyReader

TEMPLATE = Path(__file__).parent / "templates" / "openai-gpt-oss-120b.jinja"
ANSWER, THOUGHT = "Hello, world!\nWhat's up?", "I'm\nthinking"
CALL = [("special_function", {"arg1": 1})]
EDIT = {"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {",
        "replaceAll": False}
VECTORS = [  # (the model's answer, expected reasoning, content, calls): test-chat.cpp's
    ("<|channel|>final<|message|>" + ANSWER, "", ANSWER, []),
    ("<|channel|>commentary<|message|>" + ANSWER, "", ANSWER, []),
    ("<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final"
     "<|message|>" + ANSWER, THOUGHT, ANSWER, []),
    ("<|channel|>analysis<|message|>I'm\nthinking", THOUGHT, "", []),  # cut short
    (' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', "", "", CALL),
    ('<|channel|>analysis to=functions.special_function<|message|>{"arg1": 1}', "", "", CALL),
    (' to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{"arg1": 1}',
     "", "", CALL),
    ('<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}', "", "", CALL),
    ("<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant to=functions."
     'special_function<|channel|>analysis<|message|>{"arg1": 1}', THOUGHT, "", CALL),
    ("<|channel|>analysis<|message|>Thinking about edit...<|end|><|start|>assistant<|channel|>"
     "commentary to=functions.edit <|constrain|>json<|message|>" + json.dumps(EDIT),
     "Thinking about edit...", "", [("edit", EDIT)]),
    ("<|channel|>analysis<|message|>I need to output the invoice details in JSON<|end|>"
     '<|start|>assistant<|channel|>final <|constrain|>json<|message|>{"amount": 123.45}',
     "I need to output the invoice details in JSON", '{"amount": 123.45}', []),
    ("<|channel|>analysis<|message|>I will execute python to say hello<|end|><|start|>assistant"
     " to=container.exec<|channel|>commentary<|message|>python3 -c 'print(\"hello\")'",
     "I will execute python to say hello", "", []),  # a built-in tool's call: nobody's
    ("<|channel|>analysis<|message|>I will execute python to say hello<|end|><|start|>assistant"
     '<|channel|>commentary to=python <|constrain|>code<|message|>print("hello")',
     "I will execute python to say hello", "", []),
    ("<|channel|>commentary to=assistant<|channel|>analysis<|message|>I'm\nthinking<|end|>"
     "<|start|>assistant<|channel|>final<|message|>" + ANSWER, THOUGHT, ANSWER, []),
    ("<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>commentary"
     " to=assistant<|channel|>final<|message|>" + ANSWER, THOUGHT, ANSWER, []),
]


@pytest.mark.parametrize("answer, thought, content, calls", VECTORS)
def test_llama_cpps_gpt_oss_vectors_whole_and_streamed(answer, thought, content, calls):
    check(HarmonyReader, answer, (thought, content, calls))


def test_plain_text_without_headers_is_the_answer():
    check(HarmonyReader, "Just text.", ("", "Just text.", []))


@pytest.fixture(scope="module")
def gpt_oss():
    with running("-c", "2048", "-np", "1", "-t", "2", "--chat-template-file", str(TEMPLATE),
                 log_name="harmony") as srv:
        yield srv


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]


def test_apply_template_shows_the_tools_and_history_in_gpt_oss_words(gpt_oss):
    r = httpx.post(gpt_oss.url + "/apply-template", json={"messages": HISTORY,
                                                         "tools": [WEATHER]}, timeout=60)
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    assert "namespace functions" in prompt and "type get_weather" in prompt
    assert "to=functions.get_weather" in prompt and "Sunny, 21 C" in prompt


def test_a_forced_call_is_written_in_harmony_form_on_every_route(gpt_oss):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = httpx.post(gpt_oss.url + "/v1/chat/completions", timeout=120, json={
        "messages": QUESTION, "tools": [WEATHER], "tool_choice": named, "max_tokens": 80,
        "temperature": 0})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city"}
    assert "<|" not in (choice["message"]["content"] or "")
    anthropic = httpx.post(gpt_oss.url + "/v1/messages", timeout=120, json={
        "model": "m", "max_tokens": 80, "messages": QUESTION, "temperature": 0,
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "tools": [{"name": "get_weather", "description": "Current weather of a city",
                   "input_schema": WEATHER["function"]["parameters"]}]}).json()
    uses = [b for b in anthropic["content"] if b["type"] == "tool_use"]
    assert [u["name"] for u in uses] == ["get_weather"] and "city" in uses[0]["input"]
    ollama = httpx.post(gpt_oss.url + "/api/chat", timeout=120, json={
        "model": "m", "messages": QUESTION, "tools": [WEATHER], "stream": False,
        "options": {"temperature": 0, "num_predict": 80}}).json()
    assert "<|channel|>" not in ollama["message"]["content"]  # Ollama has no forcing: free
