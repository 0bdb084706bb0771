"""Reasoning split from the answer: canned <think> outputs split the same whole and in any
fragments; on the real server (--reasoning-format deepseek, the answer shaped by a grammar
since the demo model does not reason) chat, Messages and Responses carry the reasoning apart."""

import json

import anthropic
import httpx
import openai
import pytest

from conftest import running
from localserve.api.reasoning import ThinkSplitter, reasoning_kind, split_reasoning

CANNED = [
    ("<think>Let me add 2 and 2.</think>\n\nIt is 4.", ("Let me add 2 and 2.", "It is 4.")),
    ("  <think>\nhmm</think>Yes", ("\nhmm", "Yes")),
    ("No thinking here.", ("", "No thinking here.")),
    ("An answer that mentions <think> later.", ("", "An answer that mentions <think> later.")),
    ("<think>cut before the end", ("cut before the end", "")),
    ("<b>bold</b>", ("", "<b>bold</b>")),
    ("<think></think>Empty thought", ("", "Empty thought")),
]


@pytest.mark.parametrize("text, expected", CANNED)
def test_canned_outputs_split_whole_and_in_every_pair_of_fragments(text, expected):
    assert split_reasoning(text) == expected
    for cut in range(len(text) + 1):
        splitter, got = ThinkSplitter(), ["", ""]
        for piece in (text[:cut], text[cut:]):
            thought, answer = splitter.feed(piece)
            got = [got[0] + thought, got[1] + answer]
        rest = splitter.flush()
        assert (got[0] + rest[0], got[1] + rest[1]) == expected, cut


def test_one_character_at_a_time():
    text, expected = CANNED[0]
    splitter, got = ThinkSplitter(), ["", ""]
    for ch in text:
        thought, answer = splitter.feed(ch)
        got = [got[0] + thought, got[1] + answer]
    assert tuple(got) == expected


def test_auto_splits_only_for_templates_that_think():
    assert reasoning_kind("auto", "{{ '<think>' }}") == "think"
    assert not reasoning_kind("auto", "<|im_start|>")
    assert reasoning_kind("deepseek", None) == "think" and not reasoning_kind("none", "<think>")
    harmony = "<|channel|>analysis<|message|>"
    assert reasoning_kind("auto", harmony) == "harmony" and not reasoning_kind("none", harmony)
    assert reasoning_kind("auto", "{{ '<|channel>thought' }}...<channel|>") == "gemma4"


THINKING = 'root ::= "<think>" [a-z ]{3,12} "</think>" [a-z ]{3,12}'
KEY = "reasoning-key-0123456789"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    state = tmp_path_factory.mktemp("reasoning-state")
    with running("-c", "1024", "-np", "2", "-t", "2", "--reasoning-format", "deepseek",
                 "--api-key", KEY, "--state-dir", str(state), log_name="reasoning") as server:
        yield server


def chat(srv, **extra):
    body = {"messages": [{"role": "user", "content": "Think, then answer."}], "temperature": 0,
            "max_tokens": 40, "grammar": THINKING, **extra}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"})


def test_chat_gives_reasoning_content_whole_and_streamed(srv):
    message = chat(srv).json()["choices"][0]["message"]
    assert message["reasoning_content"] and "<think>" not in message["content"]
    assert "</think>" not in message["reasoning_content"] and message["content"].strip()
    thought, answer, usage = "", "", None
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}, json={
                          "messages": [{"role": "user", "content": "Think, then answer."}],
                          "temperature": 0, "max_tokens": 40, "grammar": THINKING,
                          "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    thought += choice["delta"].get("reasoning_content") or ""
                    answer += choice["delta"].get("content") or ""
    assert (thought, answer) == (message["reasoning_content"], message["content"])
    assert 0 < usage["completion_tokens_details"]["reasoning_tokens"] < usage["completion_tokens"]


def test_messages_and_responses_carry_the_reasoning_apart(srv):
    client = anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=120)
    ask = {"model": "any", "max_tokens": 40, "messages": [{"role": "user", "content": "Go."}],
           "extra_body": {"temperature": 0, "grammar": THINKING}}
    message = client.messages.create(**ask)
    assert [b.type for b in message.content] == ["thinking", "text"]
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == message.content[0].thinking
    responses = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    ask = {"model": "any", "max_output_tokens": 40, "input": "Go.", "temperature": 0,
           "extra_body": {"grammar": THINKING}}
    whole = responses.responses.create(**ask)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    spent = whole.usage.output_tokens_details.reasoning_tokens
    assert 0 < spent < whole.usage.output_tokens
    with responses.responses.stream(**ask) as stream:
        streamed = stream.get_final_response()
    assert [item.type for item in streamed.output] == ["reasoning", "message"]
    assert streamed.usage.output_tokens_details.reasoning_tokens == spent
    assert streamed.output_text == whole.output_text and "<think>" not in whole.output_text
