"""Reasoning split from the answer: canned <think> outputs split the same whole and in any
fragments; on the real server (--reasoning-format deepseek, the answer shaped by a grammar
since the demo model does not reason) chat, Messages and Responses carry the reasoning apart."""

import json
from pathlib import Path

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
    assert reasoning_kind("auto", "{{ '[THINK]' + thinking + '[/THINK]' }}") == "mistral-think"


def answer_pieces(reasoning: str, fmt_name: str, answer: str) -> tuple[str, str, list]:
    """(reasoning, content, calls) a tools answer in a model's own format gives, fed to a
    ChoiceReader a few characters at a time (tool_choice auto)."""
    from localserve.api.answer import ChoiceReader, Thought, Text, ToolCalls
    from localserve.api.structured import ToolPlan
    from localserve.models.answer_formats import FORMATS
    from localserve.engine.finish import FinishReason
    from localserve.engine.request import Request, SamplingParams, TokenEvent

    native = next(f for f in FORMATS if f.name == fmt_name)
    reader = ChoiceReader(ToolPlan(allow_text_response=True, native=native), reasoning)
    request, pieces = Request([1], SamplingParams(max_tokens=9)), []
    cuts = [answer[i:i + 4] for i in range(0, len(answer), 4)]
    for i, cut in enumerate(cuts):
        last = i == len(cuts) - 1
        pieces += reader.read(TokenEvent(cut, (1,), FinishReason.STOP if last else None),
                              request)
    thought = "".join(p.text for p in pieces if isinstance(p, Thought))
    content = "".join(p.text for p in pieces if isinstance(p, Text))
    [calls] = [p for p in pieces if isinstance(p, ToolCalls)]
    content += calls.prose or ""
    return thought, content, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                              for c in calls.calls]


@pytest.mark.parametrize("reasoning, fmt, answer, expected", [
    ("think", "hermes", '<think>plan</think>Let me check.<tool_call>{"name": "f", "arguments": '
     '{"a": 1}}</tool_call>', ("plan", "Let me check.", [("f", {"a": 1})])),  # Qwen 3
    ("mistral-think", "mistral-args", "[THINK]I'm\nthinking[/THINK][TOOL_CALLS]special_function"
     '[ARGS]{"arg1": 1}', ("I'm\nthinking", "", [("special_function", {"arg1": 1})])),
    ("mistral-think", "mistral-args", "[THINK]Let me think about [TOOL_CALLS]special_function"
     '[ARGS]{"arg1":1} and more[/THINK][TOOL_CALLS]special_function[ARGS]{"arg1": 1}',
     ('Let me think about [TOOL_CALLS]special_function[ARGS]{"arg1":1} and more', "",
      [("special_function", {"arg1": 1})])),  # a call marker inside the reasoning is not one
])
def test_reasoning_before_calls_in_a_models_own_format_is_split_off(reasoning, fmt, answer,
                                                                    expected):
    assert answer_pieces(reasoning, fmt, answer) == expected


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


TEMPLATES = Path(__file__).parent / "templates"


@pytest.mark.parametrize("name, opens", [
    ("Qwen3.5-4B", True), ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", True),
    ("Qwen-Qwen3-0.6B", False), ("openai-gpt-oss-120b", False),
    ("Apriel-1.6-15b-Thinker-fixed", True)])
def test_a_template_that_opens_the_reasoning_block_is_known_from_its_prompt(name, opens):
    from localserve.api.reasoning import opens_reasoning
    from localserve.models.chat_template import ChatTemplate

    source = (TEMPLATES / f"{name}.jinja").read_text()
    parts = ChatTemplate(source, "<s>", "</s>").render_parts([{"role": "user", "content": "Hi"}])
    assert opens_reasoning(reasoning_kind("auto", source), parts[-1].text) is opens


def test_an_answer_that_starts_inside_its_prompts_block_is_reasoning_until_it_closes():
    """llama.cpp's forced-open vectors (GLM 4.7 Flash, DeepSeek R1): the answer carries no
    opening tag."""
    from localserve.api.answer import ChoiceReader, Text, Thought
    from localserve.engine.finish import FinishReason
    from localserve.engine.request import Request, SamplingParams, TokenEvent

    for opened, expected in ((True, ("I'm\nthinking", "Hello, world!")),
                             (False, ("", "I'm\nthinking</think>Hello, world!"))):
        reader = ChoiceReader(None, "think")
        request = Request([1], SamplingParams(max_tokens=9), reasoning_open=opened)
        answer, pieces = "I'm\nthinking</think>Hello, world!", []
        for i in range(0, len(answer), 3):
            end = FinishReason.STOP if i + 3 >= len(answer) else None
            pieces += reader.read(TokenEvent(answer[i:i + 3], (1,), end), request)
        assert ("".join(p.text for p in pieces if isinstance(p, Thought)),
                "".join(p.text for p in pieces if isinstance(p, Text))) == expected


def test_apriel_thinkers_steps_end_at_its_marker():
    """Apriel 1.6 Thinker (test-chat.cpp): its prompt opens "Here are my reasoning steps:", the
    answer follows [BEGIN FINAL RESPONSE]; a call after the marker is the answer's."""
    source = (TEMPLATES / "Apriel-1.6-15b-Thinker-fixed.jinja").read_text()
    splitter = ThinkSplitter(reasoning_kind("auto", source))
    splitter.opened()
    answer = "I'm\nthinking\n[BEGIN FINAL RESPONSE]\nHello, world!\nWhat's up?"
    pieces = [splitter.feed(answer[i:i + 3]) for i in range(0, len(answer), 3)]
    pieces.append(splitter.flush())
    assert ("".join(r for r, _ in pieces).strip(), "".join(a for _, a in pieces)) == \
        ("I'm\nthinking", "Hello, world!\nWhat's up?")


def test_qwen35s_answers_start_in_the_reasoning_its_prompt_opened():
    """The embedded model with Qwen3.5's template (its generation prompt ends with <think>): a
    grammar makes it close the block, as a Qwen3.5 does; the reasoning and the answer arrive
    apart, whole and streamed."""
    grammar = 'root ::= [a-z ]{3,12} "</think>" [a-z ]{3,12}'
    with running("-c", "1024", "-np", "1", "-t", "2", "--chat-template-file",
                 str(TEMPLATES / "Qwen3.5-4B.jinja"), log_name="reasoning-open") as server:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40,
                "temperature": 0, "grammar": grammar}
        message = httpx.post(server.url + "/v1/chat/completions", json=body,
                             timeout=120).json()["choices"][0]["message"]
    assert message["reasoning_content"] and "</think>" not in message["content"]
    assert message["content"] and "</think>" not in message["reasoning_content"]
