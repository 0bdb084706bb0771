"""The table of docs/api.md over llama.cpp's own chat templates (`models/templates/*.jinja` in
its source archive: scripts/template-table): for each, whether a plain chat and a tool
conversation (tools, an assistant's call, its result) render through localserve's template
class as the server sends them, which of localserve's answer formats reads its tool calls, and
which reasoning it splits off (and whether the template's prompt opens the block itself).
Facts about rendering, not about any model's answers."""

from __future__ import annotations

import sys
from pathlib import Path

from localserve.api.reasoning import opens_reasoning, reasoning_kind
from localserve.api.schemas import ChatCompletionRequest
from localserve.api.tool_formats import template_messages, template_tools
from localserve.models.answer_formats import detect
from localserve.models.chat_template import ChatTemplate, as_alternating_turns

PLAIN = [{"role": "system", "content": "You are helpful."},
         {"role": "user", "content": "Hello!"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TOOLS = ChatCompletionRequest(tools=[WEATHER], messages=[
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_abc123", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_abc123", "content": "Sunny, 21 C"}])


def renders(template: ChatTemplate, messages: list[dict], tools=None) -> str:
    """"yes", or the first line of why not. A template that takes only alternating turns
    gets them, as the server sends them (prompt._chat_tokens)."""
    try:
        template.render_parts(messages, tools=tools)
        return "yes"
    except ValueError as first:
        try:
            template.render_parts(as_alternating_turns(messages), tools=tools)
            return "yes (turns joined)"
        except ValueError:
            return "no: " + str(first).splitlines()[0][:80].replace("|", "\\|")


def row(path: Path) -> str:
    source = path.read_text(encoding="utf-8")
    try:
        template = ChatTemplate(source, "<s>", "</s>")
    except Exception as exc:  # a template that does not compile
        return f"| {path.stem} | no: {str(exc).splitlines()[0][:60]} | - | - | - |"
    native = detect(source)
    messages = (template_messages(TOOLS.messages, native) if native
                else [m.as_template_dict() for m in TOOLS.messages])
    tools = template_tools(TOOLS.tools) if native else None
    return (f"| {path.stem} | {renders(template, PLAIN)} | {renders(template, messages, tools)} "
            f"| {native.name if native else 'generic JSON'} | {reasoning(template, source)} |")


def reasoning(template: ChatTemplate, source: str) -> str:
    """The reasoning split off, and whether the template's own prompt opens its block."""
    kind = reasoning_kind("auto", source)
    try:
        tail = template.render_parts(PLAIN)[-1].text
    except (ValueError, IndexError):
        tail = ""
    return (kind or "-") + (" (opened by the prompt)" if opens_reasoning(kind, tail) else "")


def main(folder: str) -> None:
    print("| template | plain chat | tool conversation | tool calls read as | reasoning split |")
    print("|---|---|---|---|---|")
    for path in sorted(Path(folder).glob("*.jinja")):
        print(row(path))


if __name__ == "__main__":
    main(sys.argv[1])
