"""The forced forms of api/call_forms.py (DeepSeek V3.1's and Kimi K2's named calls, MiniMax
M2's and DeepSeek's invoke elements), Apriel's call list and MiniMax M1's lines, generated on
the real model in-process: the grammar llama.cpp compiles makes the answer a call in the
model's own form, and the format's reader gives it back as OpenAI's tool call with arguments
its schema allows."""

import asyncio
import json
from pathlib import Path

import pytest

from conftest import loaded_host
from localserve.api import structured
from localserve.api.schemas import ChatCompletionRequest
from localserve.api.tool_formats import parse
from localserve.models.answer_formats import detect
from localserve.engine.request import Request, SamplingParams

TEMPLATES = Path(__file__).parent / "templates"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"},
         "unit": {"type": "string", "enum": ["C", "F"]}}, "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
     "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                    "required": ["zone"]}}},
]


@pytest.fixture(scope="module")
def host():
    with loaded_host(ctx_size=2048, parallel=1) as svc:
        yield svc


def generate(host, grammar: str) -> str:
    async def run():
        tokens = host.tokenize_prompt("Call a tool for the weather in Paris.")
        params = SamplingParams(max_tokens=400, temperature=0, grammar=grammar)
        return "".join([e.text async for e in host.engine.submit(Request(tokens, params))])

    return asyncio.run(run())


@pytest.mark.parametrize("template, family", [
    ("moonshotai-Kimi-K2", "kimi"), ("MiniMax-M2", "minimax"),
    ("deepseek-ai-DeepSeek-V4", "dsml"),  # (V3.2's form differs by its block's name only)
    ("unsloth-Apriel-1.5", "apriel"), ("MiniMax-M1", "minimax-m1"),
    ("deepseek-ai-DeepSeek-V3.1", "deepseek")])
def test_a_forced_call_is_written_in_the_models_own_form_and_read_back(host, template, family):
    fmt = detect((TEMPLATES / f"{template}.jinja").read_text())
    assert fmt.name == family
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Weather in Paris?"}],
                                 tools=TOOLS, tool_choice={"type": "function",
                                                           "function": {"name": "get_weather"}})
    _, grammar, _ = structured.native_tool_setup(host, body, body.tools[:1], fmt)
    text = generate(host, grammar)
    assert text.startswith(fmt.trigger), text
    content, calls = parse(text, fmt)
    assert content is None and len(calls) >= 1, text
    arguments = json.loads(calls[0]["function"]["arguments"])
    assert calls[0]["function"]["name"] == "get_weather", text
    if family == "kimi":  # its own form names the call functions.NAME:INDEX, kept as the id
        assert calls[0]["id"].startswith("functions.get_weather:"), text
    assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 12
    assert isinstance(arguments["days"], int) and arguments.get("unit", "C") in ("C", "F")
