"""Structured output and tool calls on the real model: grammars per slot inside one batch,
tool calls in OpenAI's shapes, real clients (openai's parse, instructor), and every hostile
schema refused with a 400 while the server keeps serving. The 135M model is weak: these
tests assert structure (valid JSON, schema-valid arguments), never wisdom."""

import asyncio
import json
import threading

import httpx
import jsonschema
import pytest
from pydantic import BaseModel

from conftest import running

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "color", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "color": {"enum": ["red", "green", "blue"]},
                         "age": {"type": "integer"}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "required": ["zone"],
                   "properties": {"zone": {"type": "string", "maxLength": 30}}}}}
FREE = ["Count from 1 to 20, separated by commas.", "List the numbers from 10 to 25."]


@pytest.fixture(scope="module")
def srv():
    with running("-c", "4096", "-np", "4", "-t", "2", log_name="structured") as s:
        yield s


def chat_body(content, **extra):
    return {"messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 60, **extra}


async def stream_chat(client, url, body):
    text, finish = "", None
    async with client.stream("POST", url + "/v1/chat/completions",
                             json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
    return text, finish


def test_schema_streams_share_steps_with_free_chats_that_stay_identical(srv):
    schema_body = chat_body("Describe a person as JSON.", max_tokens=120, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})

    async def run(bodies):
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(stream_chat(client, srv.url, b) for b in bodies))

    solo = [asyncio.run(run([chat_body(p)]))[0] for p in FREE]
    steps_before = srv.slots()["engine"]["steps"]
    results = asyncio.run(run([schema_body, schema_body] + [chat_body(p) for p in FREE]))
    for text, finish in results[:2]:
        jsonschema.validate(json.loads(text), PERSON)
        assert finish == "stop"
    assert results[2:] == solo
    assert srv.slots()["engine"]["max_decode_rows_in_step"] >= 3
    assert srv.slots()["engine"]["steps"] > steps_before


def test_json_object_mode_and_the_raw_grammar_field(srv):
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json=chat_body(
        "Give me a JSON object about a cat.", response_format={"type": "json_object"}))
    body = r.json()
    if body["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)
    else:  # cut by max_tokens: still the start of an object
        assert body["choices"][0]["message"]["content"].lstrip().startswith("{")
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json=chat_body(
        "Pick a color.", response_format={"type": "json_object", "schema": {  # llama-server's
            "type": "object", "properties": {"c": {"enum": ["red", "blue"]}}, "required": ["c"],
            "additionalProperties": False}}))  # extension: the schema is followed
    assert json.loads(r.json()["choices"][0]["message"]["content"])["c"] in ("red", "blue")
    r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
        "prompt": "Is the sky blue? Answer:", "max_tokens": 5, "grammar": 'root ::= " yes" | " no"'})
    assert r.json()["choices"][0]["text"] in (" yes", " no")
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def call_args(call, tool):
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_are_well_formed_and_their_results_can_be_sent_back(srv, choice, stream):
    body = chat_body("What is the weather in Paris, and the time in Tokyo?", max_tokens=120,
                     tools=[WEATHER, CLOCK], tool_choice=choice)
    if stream:
        calls, finish = {}, None
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    c = json.loads(line[6:])["choices"][0]
                    for part in c["delta"].get("tool_calls") or []:
                        calls.setdefault(part["index"], part)
                    finish = c["finish_reason"] or finish
        calls = [calls[i] for i in sorted(calls)]
        assert sorted(calls and range(len(calls))) == list(range(len(calls)))
    else:
        reply = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120).json()
        message, finish = reply["choices"][0]["message"], reply["choices"][0]["finish_reason"]
        assert message["content"] is None and message["refusal"] is None
        calls = message["tool_calls"]
    assert finish == "tool_calls" and calls
    offered = {"get_weather": WEATHER, "get_time": CLOCK}
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        if isinstance(choice, dict):
            assert call["function"]["name"] == "get_time"
        call_args(call, offered[call["function"]["name"]])
    history = body["messages"] + [
        {"role": "assistant", "content": None, "tool_calls": calls},
        *({"role": "tool", "tool_call_id": c["id"], "content": "22 degrees, sunny"} for c in calls)]
    follow_up = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
        "messages": history, "tools": [WEATHER, CLOCK], "max_tokens": 20, "temperature": 0})
    assert follow_up.status_code == 200, follow_up.text


def test_parallel_calls_stream_with_indexes_0_and_1():
    from localserve.api.answer import ToolCalls
    from localserve.api.replies import Reply
    from localserve.api.schemas import ChatCompletionRequest
    from localserve.api.structured import ToolPlan, parse_tool_answer

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stream=True)
    reply = Reply("chat.completion", "m", body, "fp", ToolPlan(allow_text_response=False))
    answer = json.dumps({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}},
                                        {"name": "get_time", "arguments": {"zone": "UTC"}}]})
    content, calls = parse_tool_answer(answer, reply.tools)
    chunks = [json.loads(c["data"]) for c in reply._tool_chunks(0, ToolCalls(content, calls))]
    parts = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks]
    assert [p["index"] for p in parts] == [0, 1]
    assert parts[0]["id"] != parts[1]["id"] and all(p["id"].startswith("call_") for p in parts)
    assert [p["function"]["name"] for p in parts] == ["get_weather", "get_time"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_answer_cut_by_max_tokens_never_leaks_the_format(srv, stream):
    from openai import OpenAI

    client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    ask = dict(model="any", messages=[{"role": "user", "content": "Weather in Paris?"}],
               tools=[WEATHER], tool_choice="required", max_tokens=8, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(**ask, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = client.chat.completions.create(**ask).choices[0]
        content, finish = choice.message.content or "", choice.finish_reason
        assert choice.message.tool_calls is None  # 8 tokens complete no call
    assert finish == "length" and content == ""


def test_a_cut_answer_gives_what_it_completed():
    from localserve.api.structured import ToolPlan, parse_tool_answer

    auto = ToolPlan(allow_text_response=True)
    whole = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    content, calls = parse_tool_answer('{"tool_calls": [' + whole + ', {"name": "get_w', auto)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time"]
    assert parse_tool_answer('{ "tool_calls":', auto) == (None, [])
    assert parse_tool_answer('{"response": "Hello \\"wor', auto) == ('Hello "wor', [])
    assert parse_tool_answer('{"response": "caf\\u00', auto) == ("caf", [])
    assert parse_tool_answer('{"respo', auto) == (None, [])


def test_openai_parse_and_instructor_get_validated_objects(srv):
    import instructor
    from openai import OpenAI

    class Person(BaseModel):
        name: str
        age: int

    client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    parsed = client.beta.chat.completions.parse(
        model="default", messages=[{"role": "user", "content": "Invent a person."}],
        response_format=Person, temperature=0, max_tokens=60)
    assert isinstance(parsed.choices[0].message.parsed, Person)
    person = instructor.from_openai(client, mode=instructor.Mode.TOOLS).chat.completions.create(
        model="default", response_model=Person, max_retries=0, temperature=0, max_tokens=80,
        messages=[{"role": "user", "content": "Invent a person."}])
    assert isinstance(person, Person) and isinstance(person.age, int)


class Nested:
    """A schema nested `levels` deep, as JSON text (json.dumps itself would overflow)."""

    def __init__(self, levels):
        self.text = '{"type":"object","properties":{"a":' * levels + '{"type":"string"}' + "}}" * levels


def encode(body) -> bytes:
    text = json.dumps(body, default=lambda o: "@NESTED@")
    for value in body.get("response_format", {}).get("json_schema", {}).values():
        if isinstance(value, Nested):
            text = text.replace('"@NESTED@"', value.text)
    return text.encode()


NEGATIVE = [
    ("malformed schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": 5}}}}, "schema"),
    ("unparsable grammar", {"grammar": "root ::= ("}, "grammar"),
    ("ignore_eos with a schema", {"ignore_eos": True, "response_format": {"type": "json_object"}},
     "ignore_eos"),
    ("schema nested 10,000 levels", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": Nested(10_000)}}}, ""),
    ("tool with invalid parameters", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 7}}}}}],
        "tool_choice": "required"}, "parameters"),
    ("tool_choice not offered", {"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "launch"}}}, "launch"),
    ("logit_bias keyed by text", {"logit_bias": {"hello": 5}}, "logit_bias"),
    ("mirostat out of range", {"mirostat": 3}, "mirostat"),
    ("tfs_z (removed from llama.cpp)", {"tfs_z": 0.9}, "tfs_z"),
]


def test_bad_constraints_are_400s_while_others_keep_streaming(srv):
    done = []
    body = chat_body("Write a long story.", max_tokens=200, ignore_eos=True)
    worker = threading.Thread(target=lambda: done.append(asyncio.run(_one_stream(srv.url, body))))
    worker.start()
    try:
        for name, extra, fragment in NEGATIVE:
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                           content=encode({**chat_body("hi"), **extra}),
                           headers={"content-type": "application/json"})
            assert r.status_code == 400, (name, r.text[:300])
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and fragment in error["message"], name
            assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        worker.join(timeout=300)
    assert done and done[0][1] == "length"


async def _one_stream(url, body):
    async with httpx.AsyncClient(timeout=300) as client:
        return await stream_chat(client, url, body)


def test_unknown_fields_are_named_back_and_paths_without_v1_work(srv):
    r = httpx.post(srv.url + "/chat/completions", timeout=60,
                   json={**chat_body("hi", max_tokens=2), "frobnicate": 1, "model": "gpt-4o"})
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "frobnicate"
    assert r.json()["model"] == srv.slots()["model"]  # any name: the one model answers
    models = httpx.get(srv.url + "/models").json()["data"]
    assert models[0]["created"] > 0
    assert httpx.get(srv.url + "/v1/models/" + models[0]["id"]).json()["id"] == models[0]["id"]


def test_ignored_field_names_are_always_a_legal_header_value():
    from localserve.api.replies import header_list

    assert header_list(["frobnicate", " ", "", "caf\u00e9"]) == 'frobnicate, " ", "", "caf\\u00e9"'
