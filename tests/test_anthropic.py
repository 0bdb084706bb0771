"""Anthropic's Messages API through the official `anthropic` SDK, on the real server: plain and
streamed answers agree, a tool round trip, count_tokens, errors in Anthropic's shape, and the
office's keys, quotas and ledger apply as to chat completions."""


import anthropic
import pytest

from conftest import key_file, ledger_rows, running, wait_for

KEY = "anthropic-key-0123456789"
WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    state = tmp_path_factory.mktemp("anthropic-state")
    keys = key_file(state, f"agent:{KEY}:user")
    with running("-c", "2048", "-np", "2", "-t", "2", "--api-key-file", str(keys),
                 "--state-dir", str(state), log_name="anthropic") as server:
        server.state = state
        yield server


@pytest.fixture()
def client(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=120)


def ask(**extra):
    """Greedy: this SDK version no longer has a temperature argument; the API still takes it."""
    return {"model": "any", "max_tokens": 24, "extra_body": {"temperature": 0},
            "messages": [{"role": "user", "content": "Name three fruits."}], **extra}


def test_plain_and_streamed_answers_agree(client):
    message = client.messages.create(**ask(system="You are brief."))
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 5 and 0 < message.usage.output_tokens <= 24
    with client.messages.stream(**ask(system="You are brief.")) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == message.content[0].text
    assert final.stop_reason == message.stop_reason and final.usage.output_tokens == message.usage.output_tokens


def test_a_tool_round_trip(client):
    first = client.messages.create(**ask(
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=60))
    assert first.stop_reason == "tool_use"
    call = next(b for b in first.content if b.type == "tool_use")
    assert call.name == "get_weather" and isinstance(call.input, dict) and call.id.startswith("toolu_")
    second = client.messages.create(**ask(
        messages=[{"role": "user", "content": "What is the weather in Paris?"},
                  {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                "content": "Sunny, 21 C"}]}],
        tools=[WEATHER], tool_choice={"type": "none"}, max_tokens=30))
    assert second.content[0].type == "text" and second.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(**ask(
            messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[WEATHER],
            tool_choice={"type": "any"}, max_tokens=60)) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert next(b for b in final.content if b.type == "tool_use").name == "get_weather"


def test_count_tokens_matches_what_a_request_uses(client):
    body = ask(system="You are brief.")
    counted = client.messages.count_tokens(model="any", system=body["system"],
                                           messages=body["messages"])
    assert counted.input_tokens > 5
    assert counted.input_tokens == client.messages.create(**body).usage.input_tokens


def test_errors_come_in_anthropics_shape(srv, client):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(**ask(messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}]}]))
    assert bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(**ask(thinking={"type": "sometimes"}))
    wrong = anthropic.Anthropic(base_url=srv.url, api_key="wrong-key-000000", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(**ask())
    assert refused.value.body["error"]["type"] == "authentication_error"


def test_thinking_on_a_model_that_does_not_reason_is_answered_and_named_as_ignored(client):
    """Agents turn thinking on by default (llama-server ignores it; Ollama accepts it so that
    they connect): answered, with `thinking` in X-Ignored-Fields."""
    raw = client.messages.with_raw_response.create(
        **ask(thinking={"type": "enabled", "budget_tokens": 1024}))
    assert raw.headers["x-ignored-fields"] == "thinking"
    assert raw.parse().stop_reason in ("end_turn", "max_tokens")
    plain = client.messages.with_raw_response.create(**ask(thinking={"type": "disabled"}))
    assert "x-ignored-fields" not in plain.headers


def test_the_ledger_counts_messages_requests(srv, client):
    message = client.messages.create(**ask())
    row = ("agent", message.usage.input_tokens, message.usage.output_tokens)
    wait_for(lambda: row in ledger_rows(srv.state, "/v1/messages"), what="this request's ledger row")
