"""Every writer's output, whole and streamed, for each kind of ending, compared with what it
was when reviewed (tests/writers_golden.json): what clients parse stays as it is. The events
are handcrafted (fakes.EventChoices): text, a <think> block (whole, or cut by the limit),
logprobs, a generic tool call, text where a call could have been, prose then two calls in a
model's own format, a failure, a client that left, the prompt's progress. Ids, clocks and
durations are masked. After a deliberate change of a shape, review the difference and write
the file again: LOCALSERVE_WRITE_GOLDEN=1 pytest tests/test_writers_golden.py"""

import asyncio
import json
import os
import re
from pathlib import Path

import pytest
from fakes import EventChoices

from localserve.api.answer import ChoiceReader, read, whole_answers
from localserve.api.message_reply import MessageReply
from localserve.api.native_reply import NativeReply
from localserve.api.ollama_reply import OllamaReply
from localserve.api.replies import Reply
from localserve.api.response_reply import ResponseReply
from localserve.api.routes_native import NativeCompletion
from localserve.api.routes_responses import ResponsesRequest
from localserve.api.schemas import ChatCompletionRequest, CompletionRequest, OpenAIError
from localserve.api.structured import ToolPlan
from localserve.models.answer_formats import FORMATS
from localserve.engine.finish import FinishReason
from localserve.engine.request import Request, SamplingParams, TokenEvent

GOLDEN = Path(__file__).parent / "writers_golden.json"
IDS = re.compile(r"^(chatcmpl-|cmpl-|msg_|resp_|rs_|call_|toolu_|fc_)[0-9a-f]{24}$")
CLOCKS = {"created", "created_at", "total_duration", "load_duration", "prompt_eval_duration",
          "eval_duration", "prompt_ms", "predicted_ms", "predicted_per_second",
          "prompt_per_token_ms", "prompt_per_second", "predicted_per_token_ms"}
TOP = ((5, -0.1), (6, -2.5))
HERMES = next(f for f in FORMATS if f.name == "hermes")  # a model's own calls, after its prose


def ended(reason=FinishReason.STOP, stop="eos", prompt=5, completion=3, cached=2, text=""):
    return TokenEvent(text, (9,), reason, prompt_tokens=prompt, completion_tokens=completion,
                      cached_tokens=cached, stop_type=stop)


SCENARIOS = {
    "plain": [TokenEvent("Hel", (1,)), TokenEvent("lo", (2,)), ended()],
    "cut": [TokenEvent("Hel", (1,)), TokenEvent("lo", (2,)),
            ended(FinishReason.LENGTH, "limit", text="!")],
    "word": [TokenEvent("Hi", (1,)), ended(stop="word")],
    "thought": [TokenEvent("<think>", (3,)), TokenEvent("plan", (4,)), TokenEvent("</think>", (3,)),
                TokenEvent("Hi", (1,)), ended()],
    "cut_thinking": [TokenEvent("<think>", (3,)), TokenEvent("plan", (4,)),
                     ended(FinishReason.LENGTH, "limit")],  # the limit came inside the block
    "logprobs": [TokenEvent("Hel", (1,), logprobs=(1, -0.5, TOP)),
                 TokenEvent("lo", (2,), logprobs=(2, -0.25, TOP)), ended()],
    "called": [TokenEvent('{"tool_calls": [{"name": "get_weather", '), TokenEvent(
        '"arguments": {"city": "Paris"}}]}'), ended()],
    "replied": [TokenEvent('{"response": "Hi'), TokenEvent(' there"}'), ended()],  # no call
    "prose_calls": [TokenEvent("Let me look. "), TokenEvent(
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'),
        TokenEvent('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'), ended()],
    "failed": [TokenEvent("Hel", (1,)), TokenEvent("", finish_reason=FinishReason.ERROR,
                                                   error="the engine stopped")],
    "timeout": [TokenEvent("", finish_reason=FinishReason.TIMEOUT, error="waited too long")],
    "left": [TokenEvent("Hel", (1,))],
    "costly": [TokenEvent("", finish_reason=FinishReason.GRAMMAR_COST, error="grammar too costly")],
    "aborted": [TokenEvent("Hel", (1,)), TokenEvent("", finish_reason=FinishReason.ABORT)],
    "progress": [TokenEvent("", progress=(5, 2, 3, 10)), TokenEvent("", progress=(5, 2, 5, 12)),
                 TokenEvent("Hi", (1,)), ended()],  # return_progress: llama-server's shape
}


def choices(scenario: str, n: int = 1) -> EventChoices:
    requests = [Request([1, 2, 3, 4, 5], SamplingParams(), request_id=f"r{i}") for i in range(n)]
    for r in requests:
        r.admitted_time = r.first_token_time = r.arrival_time
        r.output_tokens = [1, 2, 9]
    events = [(i, event) for event in SCENARIOS[scenario] for i in range(n)]
    return EventChoices(requests, events)


def masked(value):
    if isinstance(value, dict):
        return {k: "<clock>" if k in CLOCKS else masked(v) for k, v in value.items()}
    if isinstance(value, list):
        return [masked(v) for v in value]
    found = IDS.match(value) if isinstance(value, str) else None
    return found.group(1) + "<id>" if found else value


def shown(item):
    """A streamed item as a client parses it."""
    if isinstance(item, str):
        return masked(json.loads(item))
    data = item.get("data")
    try:
        data = json.loads(data)
    except (TypeError, ValueError):
        pass
    return masked({**item, "data": data})


def run(coroutine):
    try:
        return asyncio.run(coroutine)
    except OpenAIError as exc:
        return {"raised": exc.status, "body": exc.body(), "headers": exc.headers}


async def drain(generator):
    return [shown(item) async for item in generator]


def chat(**extra):
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **extra)


def writers(scenario: str):
    """(name, a fresh writer's whole answer, a fresh writer's stream) for the scenario."""
    tools = {"called": ToolPlan(allow_text_response=False),
             "replied": ToolPlan(allow_text_response=True),
             "prose_calls": ToolPlan(allow_text_response=True, native=HERMES)}.get(scenario)
    thinks = scenario in ("thought", "cut_thinking")
    n = 2 if scenario == "plain" else 1
    logprobs = {"logprobs": True, "top_logprobs": 2} if scenario == "logprobs" else {}
    make = {
        "chat": lambda: Reply("chat.completion", "m", chat(n=n, stream_options={
            "include_usage": True}, **logprobs), "fp", tools, lambda t: b"ab"[t % 2:t % 2 + 1],
            thinks),
        "text": lambda: _text_reply(logprobs),
        "native": lambda: NativeReply("m", NativeCompletion(prompt="p", return_tokens=True,
                                                             n_probs=2 if logprobs else 0),
                                      lambda t: b"x\xff" if t == 5 else b"xy"),
        "ollama_chat": lambda: OllamaReply("m", True, tools, thinks, True, 0.0, 0.0),
        "ollama_generate": lambda: OllamaReply("m", False, tools, thinks, False, 0.0, 0.0),
        "messages": lambda: MessageReply("m", 5, tools, thinks),
        "responses": lambda: _stored_reply(tools, thinks),
    }
    for name, writer in make.items():
        if scenario == "progress" and name not in ("chat", "text", "native"):
            continue  # only llama-server's shapes take return_progress (not an extension)
        stream = {"chat": "sse", "text": "sse", "ollama_chat": "lines",
                  "ollama_generate": "lines"}.get(name, "events")
        k = n if name in ("chat", "text") else 1  # the others write one choice
        yield (name, masked(run(writer().collect(choices(scenario, k), None))),
               run(drain(getattr(writer(), stream)(choices(scenario, k)))))


KEPT: list = []  # what a stored response keeps (previous_response_id's turns)


def _stored_reply(tools, thinks) -> ResponseReply:
    reply = ResponseReply("m", ResponsesRequest(model="m", input="hi"), 5, tools, thinks)
    reply.turns = [{"role": "user", "content": "hi"}]

    async def keep(response, messages):
        KEPT.append(messages)
    reply.keep = keep
    return reply


def _text_reply(logprobs):
    reply = Reply("text_completion", "m", CompletionRequest(model="m", prompt="x", echo=True,
                                                           logprobs=2 if logprobs else None),
                  "fp", piece=lambda t: b"ab"[t % 2:t % 2 + 1])
    reply.prefix = "x"
    return reply


def outputs() -> dict:
    KEPT.clear()  # a run of its own (mutmut runs the tests again in one process)
    found = {f"{scenario}/{name}": {"whole": whole, "streamed": streamed}
             for scenario in SCENARIOS for name, whole, streamed in writers(scenario)}
    found["kept by stored responses"] = masked(KEPT)
    return found


def test_every_writer_writes_what_it_wrote_when_reviewed():
    found = outputs()
    if os.environ.get("LOCALSERVE_WRITE_GOLDEN"):
        GOLDEN.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert set(found) == set(golden)
    for key in sorted(golden):
        assert json.loads(json.dumps(found[key])) == golden[key], key


def test_a_reader_that_leaves_cancels_and_every_choice_ends():
    stream = choices("plain", 2)

    async def first_piece():
        async for index, piece in read(stream, [ChoiceReader(), ChoiceReader()]):
            return index, piece
    assert asyncio.run(first_piece())[0] == 0 and stream.cancelled
    answers = asyncio.run(whole_answers(choices("plain", 2), [ChoiceReader(), ChoiceReader()],
                                        None))
    assert [a.text for a in answers] == ["Hello", "Hello"]
    with pytest.raises(OpenAIError) as left:
        asyncio.run(whole_answers(choices("left"), [ChoiceReader()], None))
    assert left.value.status == 499
