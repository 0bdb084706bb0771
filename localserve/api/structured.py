"""Structured output and tool calls: from request fields to one GBNF grammar per request, and
from the constrained text back to OpenAI's shapes.

- `response_format` {"type": "json_object"} or {"type": "json_schema", ...}, llama-server's
  top-level `json_schema`, and its raw `grammar` each become the request's grammar.
- `tools` use a generic prompt format (as llama-server's "generic" handler does; SmolLM2 and
  most small models have no native tool template): the tool list goes into the system
  message, and the answer is constrained to JSON, either {"tool_calls": [{"name", "arguments"}]}
  or, with tool_choice "auto", {"response": "..."}. The JSON is parsed here into
  message.tool_calls (or content) after generation.
Everything is checked before a slot is spent, on a worker thread (the routes call in through
`run_in_threadpool`): size, nesting and repetition bounds on the raw text (grammar_bounds.py),
the schema converter's refusals, llama.cpp's own grammar parser (a grammar it cannot parse is a
400, never a NULL sampler in the engine), and what one constrained token costs to sample.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

from localserve.api import call_forms, gemma4, harmony, tool_formats
from localserve.api.grammar_bounds import BoundError, check_gbnf, check_schema
from localserve.api.schema_patterns import PatternError, plain_patterns
from localserve.models import answer_formats
from localserve.models.answer_formats import NativeFormat
from localserve.api.schemas import ChatCompletionRequest, NamedToolChoice, OpenAIError, SamplingBody
from localserve.models.model_host import ModelHost

MAX_SCHEMA_BYTES = 64 * 1024  # a schema (or all tools' schemas) as JSON
MAX_SCHEMA_DEPTH = 32  # nested objects/arrays in a schema; llama-server crashes on deep ones
MAX_GRAMMAR_BYTES = 64 * 1024
MAX_TOOLS = 64
MAX_CALLS_PER_ANSWER = 8


@dataclass(frozen=True)
class ToolPlan:
    """What a tools request needs after generation: parse the answer into calls."""

    allow_text_response: bool  # tool_choice "auto": text instead of calls is allowed too
    native: NativeFormat | None = None  # the model's own format (tool_formats.py), else generic
    template_tools: list | None = None  # the tools, for a template that renders them


def depth(value) -> int:
    """Nesting depth of a JSON-like value, without recursion (a hostile schema may be
    thousands of levels deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        deepest = max(deepest, level)
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _check_schema(schema, param: str) -> str:
    if not isinstance(schema, dict):
        raise OpenAIError(400, f"{param}: a JSON schema must be an object", param=param)
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_BYTES:
        raise OpenAIError(400, f"{param}: the JSON schema is {len(text)} bytes; the limit is "
                          f"{MAX_SCHEMA_BYTES}", param=param)
    if depth(schema) > MAX_SCHEMA_DEPTH:
        raise OpenAIError(400, f"{param}: the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} "
                          f"levels", param=param)
    try:
        check_schema(schema)
    except BoundError as exc:
        raise OpenAIError(400, f"{param}: {exc}", param=param) from None
    return text


def schema_grammar(host: ModelHost, schema, param: str) -> str:
    text = _check_schema(schema, param)
    try:
        text = json.dumps(plain_patterns(json.loads(text)))
    except PatternError as exc:
        raise OpenAIError(400, f"{param}: {exc}", param=param) from None
    try:
        return host.json_schema_grammar(text)
    except Exception as exc:  # the converter asserts on schemas it does not understand
        raise OpenAIError(400, f"unsupported or invalid JSON schema in {param}: {exc}",
                          param=param) from None


def schema_constraint(host: ModelHost, schema, param: str) -> str:
    """A schema's grammar, converted and checked by llama.cpp's own parser."""
    return checked_grammar(host, schema_grammar(host, schema, param), param)


def checked_grammar(host: ModelHost, gbnf: str, param: str) -> str:
    if len(gbnf.encode()) > MAX_GRAMMAR_BYTES:
        raise OpenAIError(400, f"the grammar is longer than {MAX_GRAMMAR_BYTES} bytes", param=param)
    problem = CHECKED.problem(host, gbnf)
    if problem:
        raise OpenAIError(400, f"{param}: {problem}", param=param)
    return gbnf


class CheckedGrammars:
    """What checking a grammar found (its bounds, then llama.cpp's parse and the timed pass
    over the vocabulary), kept per model for the last CHECKED_KEPT grammars: the same tool or
    schema grammar sent every turn is checked once, and one sent again and again to load the
    server (a grammar the engine ends as too costly) costs a lookup, not a pass."""

    def __init__(self, kept: int = 256):
        self.kept, self._found, self._lock = kept, OrderedDict(), threading.Lock()

    def problem(self, host: ModelHost, gbnf: str) -> str | None:
        key = (str(host.model_path), hashlib.sha256(gbnf.encode()).hexdigest())
        with self._lock:
            if key in self._found:
                self._found.move_to_end(key)
                return self._found[key]
        try:
            check_gbnf(gbnf)
            found = host.grammar_error(gbnf)
            found = f"invalid grammar: {found}" if found else None
        except BoundError as exc:
            found = str(exc)
        with self._lock:
            self._found[key] = found
            while len(self._found) > self.kept:
                self._found.popitem(last=False)
        return found


CHECKED = CheckedGrammars()


def request_grammar(host: ModelHost, body: SamplingBody) -> str | None:
    """The grammar for response_format / json_schema / grammar (at most one of them)."""
    fmt = body.response_format
    sources = [name for name, present in (
        ("response_format", fmt is not None and fmt.type != "text"),
        ("json_schema", body.json_schema is not None), ("grammar", body.grammar is not None))
        if present]
    if len(sources) > 1:
        raise OpenAIError(400, f"use one of {', '.join(sources)}, not several", param=sources[1])
    if not sources:
        return None
    if body.ignore_eos:
        raise OpenAIError(400, "ignore_eos cannot be combined with a grammar or schema: the "
                          "answer must be able to end when it is complete", param="ignore_eos")
    if body.grammar is not None:
        return checked_grammar(host, body.grammar, "grammar")
    if body.json_schema is not None:
        return schema_constraint(host, body.json_schema, "json_schema")
    if fmt.type == "json_object":
        return schema_constraint(host, fmt.schema_ or {"type": "object"}, "response_format")
    if fmt.json_schema is None:
        raise OpenAIError(400, "response_format json_schema needs a 'json_schema' object with "
                          "a 'schema'", param="response_format.json_schema")
    return schema_constraint(host, fmt.json_schema.schema_, "response_format.json_schema.schema")


# ---- tools -------------------------------------------------------------------------------

def tool_setup(host: ModelHost, body: ChatCompletionRequest) -> tuple[list[dict], str, ToolPlan] | None:
    """(messages with the tool prompt, grammar, plan) for a request that offers tools and may
    call them; None when it does not (no tools, or tool_choice "none")."""
    choice = body.tool_choice
    if not body.tools or choice == "none":
        if choice not in (None, "none", "auto"):
            raise OpenAIError(400, "tool_choice names a tool, but no tools were sent",
                              param="tool_choice")
        return None
    if body.response_format is not None and body.response_format.type != "text":
        raise OpenAIError(400, "use tools or response_format, not both", param="response_format")
    for field in ("grammar", "json_schema"):  # the tools' grammar would replace them unsaid
        if getattr(body, field, None) is not None:
            raise OpenAIError(400, f"use tools or {field}, not both", param=field)
    if len(body.tools) > MAX_TOOLS:
        raise OpenAIError(400, f"at most {MAX_TOOLS} tools", param="tools")
    tools = body.tools
    if isinstance(choice, NamedToolChoice):
        wanted = choice.function.name
        tools = [t for t in body.tools if t.function.name == wanted]
        if not tools:
            raise OpenAIError(400, f"tool_choice names '{wanted}', which is not among the tools "
                              f"offered ({', '.join(t.function.name for t in body.tools)})",
                              param="tool_choice")
    for i, t in enumerate(tools):  # each alone first, so that an error names its tool
        schema_grammar(host, t.function.parameters, f"tools[{i}].function.parameters")
    native = answer_formats.detect(host.template_source)
    if native is not None:
        return native_tool_setup(host, body, tools, native)
    calls = [{"type": "object", "properties": {
        "name": {"const": t.function.name}, "arguments": t.function.parameters},
        "required": ["name", "arguments"]} for t in tools]
    call_list = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                 "minItems": 1}
    # One list of calls, then the answer ends: a weak model would otherwise repeat a call
    # until max_tokens.
    call_list["maxItems"] = 1 if body.parallel_tool_calls is False else MAX_CALLS_PER_ANSWER
    answer = {"type": "object", "properties": {"tool_calls": call_list}, "required": ["tool_calls"]}
    auto = choice in (None, "auto")
    if auto:
        answer = {"anyOf": [answer, {"type": "object", "properties": {
            "response": {"type": "string"}}, "required": ["response"]}]}
    grammar = schema_constraint(host, answer, "tools")
    messages = with_system_text([m.as_template_dict() for m in body.messages],
                                tool_prompt(tools, auto))
    return messages, grammar, ToolPlan(allow_text_response=auto)


def with_system_text(messages: list[dict], text: str) -> list[dict]:
    """The messages with `text` at the end of their system message (one put first if none)."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def native_tool_setup(host: ModelHost, body: ChatCompletionRequest, tools, fmt: NativeFormat):
    """The model's own format: the template renders the tools and the history; "auto" leaves
    the answer free (prose, then calls in the format), otherwise the whole answer is calls."""
    auto = body.tool_choice in (None, "auto")
    plan = ToolPlan(allow_text_response=auto, native=fmt,
                    template_tools=tool_formats.template_tools(body.tools))
    messages = tool_formats.template_messages(body.messages, fmt)
    if fmt.tools_unseen:  # its template writes calls, not the tools
        messages = with_system_text(messages, call_forms.TOOL_PROMPTS[fmt.name](body.tools))
    if auto:
        return messages, None, plan
    most = 1 if body.parallel_tool_calls is False or fmt.name == "llama3" else MAX_CALLS_PER_ANSWER
    if fmt.xml:  # tagged calls (Qwen3.5's, Seed-OSS's, GLM's)
        return messages, checked_grammar(host, tool_formats.xml_grammar(tools, fmt, most),
                                         "tools"), plan
    if fmt.name == "gemma4":
        return messages, checked_grammar(host, gemma4.grammar(tools, most), "tools"), plan
    if fmt.name in ("harmony", "mistral-args") or fmt.named:  # a name, its arguments' JSON
        named = [(t.function.name, schema_grammar(host, t.function.parameters,
                                                  f"tools[{i}].function.parameters"))
                 for i, t in enumerate(tools)]
        if fmt.named:
            form = call_forms.NAMED[fmt.named]
            gbnf = call_forms.named_grammar(*tool_formats.named_calls(
                named, form.separator, call_forms.call_head(form)), form, most)
        elif fmt.name == "harmony":  # one call a turn
            gbnf = harmony.grammar(named)
        else:
            gbnf = tool_formats.args_grammar(named, fmt, most)
        return messages, checked_grammar(host, gbnf, "tools"), plan
    call = schema_grammar(host, tool_formats.call_schema(tools, fmt), "tools")
    grammar = checked_grammar(host, tool_formats.wrap_grammar(call, fmt, most), "tools")
    return messages, grammar, plan


def tool_prompt(tools, auto: bool) -> str:
    listing = json.dumps([{"name": t.function.name, "description": t.function.description or "",
                           "parameters": t.function.parameters} for t in tools], indent=1)
    forms = '{"tool_calls": [{"name": "<tool name>", "arguments": {...}}]}'
    if auto:
        forms += ' to call tools, or {"response": "<your answer>"} to answer directly'
    return (f"You can call these tools:\n{listing}\n\nReply with JSON only: {forms}. "
            f"A tool's result comes back in a message from the role 'tool'.")


def parse_tool_answer(text: str, plan: ToolPlan) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) from the constrained JSON answer. An answer cut by max_tokens
    gives the calls it completed, or the text so far of its {"response": ...}: the JSON
    format itself never reaches the client."""
    if plan.native is not None:
        content, calls = tool_formats.parse(text, plan.native)
        return (None if not calls and not plan.allow_text_response else content), calls
    try:
        answer = json.loads(text)
    except ValueError:
        return _salvage(text)
    if isinstance(answer, dict) and "tool_calls" in answer:
        return None, [_call(call) for call in answer["tool_calls"]]
    if plan.allow_text_response and isinstance(answer, dict) and "response" in answer:
        return answer["response"], []
    return text, []


def tool_finish(finish: str, called: bool) -> str:
    """'tool_calls' when the answer called tools, unless it was cut ('length' stays: the
    client must know the list may be incomplete)."""
    return "tool_calls" if called and finish != "length" else finish


def _call(call: dict) -> dict:
    return tool_formats.openai_call(call["name"], json.dumps(call["arguments"]))


CUT_CALLS = re.compile(r'\s*\{\s*"tool_calls"\s*:\s*\[')
CUT_RESPONSE = re.compile(r'\s*\{\s*"response"\s*:\s*"')


def _salvage(text: str) -> tuple[str | None, list[dict]]:
    """What a cut answer completed: each whole call of a cut list, or a cut response's text."""
    if found := CUT_CALLS.match(text):  # the list's complete items, from its "["
        return None, [_call(call) for call in tool_formats.json_values(text[found.end() - 1:])
                      if isinstance(call, dict) and {"name", "arguments"} <= call.keys()]
    if found := CUT_RESPONSE.match(text):
        rest = text[found.end():]
        for cut in range(len(rest), max(len(rest) - 8, -1), -1):  # a cut escape, or '"' + '}'
            try:
                return json.loads('"' + rest[:cut] + '"'), []
            except ValueError:
                continue
    return None, []
