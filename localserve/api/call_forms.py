"""Two families of models' own tool-call forms beside tool_formats.py's (models/answer_formats.py
names which template writes which), read and forced as llama.cpp's tests/test-chat.cpp expects:

    named   a call's name, a separator, its arguments' JSON, between the model's markers.
            DeepSeek V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
            <｜tool▁call▁end｜><｜tool▁calls▁end｜> (its template does not show the tools: they go in
            a system message in its model card's words, TOOL_PROMPTS). Kimi K2:
            <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
            <|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|> (the id
            functions.NAME:0 kept as the call's id)
    invoke  an invoke element per call with a parameter element per argument. MiniMax M2:
            <minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="KEY">value</parameter>
            \\n</invoke>\\n</minimax:tool_call>; DeepSeek V3.2 and V4 the same in DSML
            (<｜DSML｜function_calls>, V4's <｜DSML｜tool_calls>), each parameter saying whether its
            value is text (string="true") or JSON (string="false")
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from localserve.models.answer_formats import DSML


@dataclass(frozen=True)
class NamedCalls:
    """A named form's markers: the section around the calls, each call's opening, the
    separator before its arguments and its end."""

    section: tuple[str, str]
    call: str
    separator: str
    end: str
    indexed: bool = False  # functions.NAME:INDEX (Kimi's), read back to NAME, kept as the id


NAMED = {"deepseek": NamedCalls(("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
                                "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"),
         "kimi": NamedCalls(("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
                            "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                            "<|tool_call_end|>", indexed=True)}

INDEXED_NAME = re.compile(r"functions\.(.+):\d+")


def named_calls(text: str, form: NamedCalls) -> list[dict]:
    """The complete calls written in `text` as {"name", "arguments" (, "id")}."""
    calls = []
    for block in text.split(form.call)[1:]:
        if form.end not in block or form.separator not in block:
            continue
        head, arguments = block.split(form.end)[0].split(form.separator, 1)
        try:
            parsed = json.loads(arguments)
        except ValueError:
            continue
        head = head.strip()
        indexed = INDEXED_NAME.fullmatch(head) if form.indexed else None
        call = {"name": indexed.group(1) if indexed else head, "arguments": parsed}
        calls.append({**call, "id": head} if indexed else call)
    return calls


def call_head(form: NamedCalls):
    """How a call's NAME and separator are written in the form's grammar, where not as one
    literal (for tool_formats.named_calls; None: as one): Kimi's as functions.NAME:INDEX, the
    separator after the index."""
    if not form.indexed:
        return None
    return lambda name, between: f'{json.dumps(f"functions.{name}:")} [0-9] {json.dumps(between)}'


def named_grammar(calls: str, rules: list[str], form: NamedCalls, most: int) -> str:
    """1..most calls in the named form, forced: `calls` the alternatives over the tools and
    `rules` what they use (tool_formats.named_calls, written with call_head)."""
    one = f"{json.dumps(form.call)} {calls} {json.dumps(form.end)}"
    more = f" ({one}){{0,{most - 1}}}" if most > 1 else ""
    opening, closing = (json.dumps(marker) for marker in form.section)
    return "\n".join([f"root ::= {opening} {one}{more} {closing}", *rules])


# ---- invoke elements ---------------------------------------------------------------------

def invoke_tags(style: str) -> tuple[str, str]:
    """(what each element's name starts with, the attribute a DSML parameter adds) for an
    invoke style: "invoke" (MiniMax M2's plain tags) or "dsml" (DeepSeek's)."""
    return (DSML, ' string="true"') if style == "dsml" else ("", "")


def invoke_calls(text: str, style: str, tagged_value) -> list[dict]:
    """The complete invoke elements in `text` as {"name", "arguments"}: a DSML parameter's value
    is JSON where it says string="false" (else text), a plain one JSON where it reads as a
    number, boolean, null, object or list (`tagged_value`)."""
    tag = re.escape(invoke_tags(style)[0])
    calls = []
    for name, body in re.findall(rf'<{tag}invoke name="([^"]+)">(.*?)</{tag}invoke>', text,
                                 re.DOTALL):
        arguments = {}
        for key, string, value in re.findall(
                rf'<{tag}parameter name="([^"]+)"(?: string="(true|false)")?>(.*?)</{tag}parameter>',
                body, re.DOTALL):
            arguments[key] = value if string == "true" else tagged_value(value)
        calls.append({"name": name, "arguments": arguments})
    return calls


def invoke_grammar(tools, trigger: str, close: str, style: str, most: int, value_of) -> str:
    """1..most invoke elements between `trigger` and `close`, forced: each tool's required
    parameters in its schema's order, the others optional, each value as `value_of(schema)`
    types it (tool_formats.xml_value); a DSML parameter says string="true" where its schema
    types it as text, "false" otherwise."""
    tag, _ = invoke_tags(style)

    def parameter(key: str, typed: dict) -> str:
        text = typed.get("type", "string") == "string"
        attribute = "" if not tag else f' string="{"true" if text else "false"}"'
        opening = "<" + tag + 'parameter name="' + key + '"' + attribute + ">"
        closing = "</" + tag + "parameter>"
        return f'{json.dumps(opening)} {value_of(typed)} {json.dumps(closing)} "\\n"'

    rules, calls = [], []
    for i, tool in enumerate(tools):
        head = json.dumps("<" + tag + 'invoke name="' + tool.function.name + '">\n')
        end = json.dumps("</" + tag + "invoke>")
        rules.append(f'call-{i} ::= {head} {parameters(tool, parameter)} {end} "\\n"')
        calls.append(f"call-{i}")
    one = f'({" | ".join(calls)})'
    more = f" {one}{{0,{most - 1}}}" if most > 1 else ""
    root = f'root ::= {json.dumps(trigger + chr(10))} {one}{more} {json.dumps(close)}'
    return "\n".join([root, *rules, "xml-value ::= [^<]+"])


def parameters(tool, one) -> str:
    """A tool's parameters in its schema's order, each as `one(key, its schema)` writes it: the
    required ones, the others optional."""
    schema = tool.function.parameters or {}
    required = set(schema.get("required", ()))
    written = []
    for key, typed in schema.get("properties", {}).items():
        rule = one(key, typed if isinstance(typed, dict) else {})
        written.append(rule if key in required else f"({rule})?")
    return " ".join(written)


def deepseek_tool_prompt(tools) -> str:
    """DeepSeek V3.1's tools in a system message, in its model card's words."""
    listing = "\n\n".join(f"### {t.function.name}\nDescription: {t.function.description or ''}"
                           f"\n\nParameters: {json.dumps(t.function.parameters or {})}"
                           for t in tools)
    return ("## Tools\nYou have access to the following tools:\n\n" + listing +
            "\n\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>"
            "tool_call_arguments<｜tool▁call▁end｜>{additional_tool_calls}<｜tool▁calls▁end｜>\n\n"
            "Where:\n\n- `tool_call_name` must be an exact match to one of the available tools\n"
            "- `tool_call_arguments` must be valid JSON that strictly follows the tool's "
            "Parameters Schema\n- For multiple tool calls, chain them directly without "
            "separators or spaces")


TOOL_PROMPTS = {"deepseek": deepseek_tool_prompt}  # by NativeFormat.name, where tools_unseen
