"""OpenAI's Responses API through the official `openai` client, on the real server: plain and
streamed answers agree, a function tool round trip, text.format json_schema, a chain by
previous_response_id that another key cannot follow, and refusals by name."""

import json

import httpx
import openai
import pytest

from conftest import key_file, ledger_rows, running, wait_for

KEY, OTHER = "responses-key-0123456789", "responses-other-0123456789"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    state = tmp_path_factory.mktemp("responses-state")
    keys = key_file(state, f"agent:{KEY}:user", f"other:{OTHER}:user")
    with running("-c", "2048", "-np", "2", "-t", "2", "--api-key-file", str(keys),
                 "--state-dir", str(state), log_name="responses") as server:
        server.state = state
        yield server


def client_for(srv, key=KEY):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture()
def client(srv):
    return client_for(srv)


def ask(**extra):
    return {"model": "any", "max_output_tokens": 24, "temperature": 0,
            "input": "Name three fruits.", **extra}


def test_plain_and_streamed_answers_agree(client):
    response = client.responses.create(**ask(instructions="You are brief."))
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete") and response.output_text
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert response.usage.input_tokens > 5 and 0 < response.usage.output_tokens <= 24
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    with client.responses.stream(**ask(instructions="You are brief.")) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    # The last event carries the whole response: response.completed, or response.incomplete
    # where max_output_tokens cut it (OpenAI's; the client's get_final_response knows only
    # the first)
    final = events[-1].response
    assert events[-1].type == f"response.{final.status}"
    assert "".join(deltas) == response.output_text == final.output_text
    assert final.status == response.status and final.usage.output_tokens == response.usage.output_tokens


def test_a_function_tool_round_trip(client):
    first = client.responses.create(**ask(
        input="What is the weather in Paris?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60))
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments), dict)
    assert first.status == "completed"
    second = client.responses.create(**ask(input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
        tools=[WEATHER], tool_choice="none"))
    assert second.output_text and all(item.type == "message" for item in second.output)


def test_streamed_tool_call_arrives_as_its_items(client):
    with client.responses.stream(**ask(input="Weather in Rome?", tools=[WEATHER],
                                       tool_choice="required", max_output_tokens=60)) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    assert [item.type for item in final.output] == ["function_call"]


def test_text_format_json_schema_validates(client):
    schema = {"type": "object", "properties": {"fruit": {"type": "string"}},
              "required": ["fruit"], "additionalProperties": False}
    response = client.responses.create(**ask(max_output_tokens=40, text={"format": {
        "type": "json_schema", "name": "pick", "schema": schema, "strict": True}}))
    assert set(json.loads(response.output_text)) == {"fruit"}


def test_previous_response_id_continues_only_for_its_key(srv, client):
    first = client.responses.create(**ask(input="My name is Ada. Say hello."))
    again = client.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text
    second = client.responses.create(**ask(input="What is my name?", previous_response_id=first.id))
    alone = client.responses.create(**ask(input="What is my name?", store=False))
    # the earlier turns are in the prompt: more input tokens than the question alone
    assert second.usage.input_tokens > alone.usage.input_tokens + 10
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(alone.id)  # store: false keeps nothing
    stranger = client_for(srv, OTHER)
    with pytest.raises(openai.NotFoundError):
        stranger.responses.create(**ask(input="Go on.", previous_response_id=first.id))
    with pytest.raises(openai.NotFoundError):
        stranger.responses.retrieve(first.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_what_cannot_be_honoured_is_refused_by_name(client):
    for extra, named in (({"tools": [{"type": "web_search"}]}, "tools[0]"),
                         ({"reasoning": {"effort": "high"}}, "reasoning"),
                         ({"extra_body": {"background": True}}, "background"),
                         ({"input": [{"role": "user", "content": [
                             {"type": "input_image", "image_url": "file:///etc/passwd"}]}]}, "input[0]")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(**ask(**extra))
        assert refused.value.body["param"] == named


def test_input_tokens_and_the_ledger_count_responses(srv, client):
    counted = client.post("/responses/input_tokens", cast_to=object,
                          body={"model": "any", "input": "Name three fruits."})
    assert counted["input_tokens"] > 3
    response = client.responses.create(**ask())
    row = ("agent", response.usage.input_tokens, response.usage.output_tokens)
    wait_for(lambda: row in ledger_rows(srv.state, "/v1/responses"), what="its ledger row")


def test_the_ledger_bills_n_choices_their_prompt_once_and_a_cancelled_stream_what_it_used(srv):
    """What usage says, the ledger keeps: n = 2 bills the prompt once (the scheduler decides,
    once); a stream the client leaves is kept as an abort (499) with the tokens it got."""
    headers = {"Authorization": f"Bearer {KEY}"}
    reply = httpx.post(srv.url + "/v1/chat/completions", headers=headers, timeout=120, json={
        "messages": [{"role": "user", "content": "Name a fruit."}], "n": 2, "max_tokens": 8,
        "temperature": 0.7, "seed": 3}).json()
    rows = wait_for(lambda: len(r := ledger_rows(srv.state, "/v1/chat/completions")) == 2 and r,
                    what="a ledger row per choice")
    assert sum(p for _, p, _ in rows) == reply["usage"]["prompt_tokens"]  # once, not twice
    assert sorted(p for _, p, _ in rows)[0] == 0
    assert sum(c for _, _, c in rows) == reply["usage"]["completion_tokens"]
    with httpx.stream("POST", srv.url + "/v1/completions", headers=headers, timeout=120, json={
            "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
            "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break  # the client leaves mid-answer
    row = wait_for(lambda: ledger_rows(srv.state, "/v1/completions",
                                       "finish_reason, status, completion_tokens"),
                   what="the cancelled stream's row")[0]
    assert row[:2] == ("abort", 499) and 0 < row[2] < 400


def test_a_base_url_without_v1_reaches_the_responses_api_too(srv):
    """As /chat/completions does: a client given the bare server address creates, reads and
    deletes a stored response."""
    bare = openai.OpenAI(base_url=srv.url, api_key=KEY, max_retries=0, timeout=120)
    made = bare.responses.create(model="any", input="Say hi.", max_output_tokens=4, store=True)
    assert made.status in ("completed", "incomplete")
    assert bare.responses.retrieve(made.id).id == made.id
    bare.responses.delete(made.id)
