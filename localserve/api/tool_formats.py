"""Models' own tool-call formats: a model whose chat template renders `tools` was trained to
call them in its own words, so tools and tool history go through that template, and its
answer is read in that format:

    gemma4   <|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>  (Gemma 4: gemma4.py)
    harmony  <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}  (gpt-oss:
             reasoning and calls read in harmony.py)
    qwen3-coder <tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>
             (Qwen3.5, Qwen3-Coder, Nemotron 3, StepFun 3.5; Seed-OSS's in <seed:tool_call>)
    hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>, repeated  (Qwen 2.5/3, Hermes)
    mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "9 chars"}]   (Mistral Nemo)
    mistral-args [TOOL_CALLS]NAME[ARGS]{...}, repeated  (Mistral Small 3.2, Devstral, Ministral 3,
             Magistral)
    granite  <|tool_call|>[{"name": ..., "arguments": {...}}]                    (Granite 3.x)
    llama3   {"name": ..., "parameters": {...}}, maybe after <|python_tag|>     (Llama 3.1-3.3)
    command-r <|START_ACTION|>[{"tool_name": ..., "parameters": {...}}]<|END_ACTION|> (Command R7B)
    apriel   <tool_calls>[{"name": ..., "arguments": {...}}]</tool_calls>          (Apriel 1.5)
    deepseek, kimi, minimax, dsml: DeepSeek V3.1's, Kimi K2's, MiniMax M2's, DeepSeek V3.2's
             and V4's (call_forms.py)

Templates without tools (SmolLM2, Gemma 2, DeepSeek R1 distills, whose templates do not show
the model its tools) keep the generic JSON format (structured.py); DeepSeek V3.1's writes its
own calls, so its tools go in a system message (call_forms.py).

With tool_choice "auto" the answer is not constrained: prose streams until the format's
trigger appears, the calls after it are parsed once complete. (llama.cpp's lazy grammar, which
would constrain only from the trigger on, throws a C++ exception through the C API when the
text replayed at the trigger does not fit the grammar: that aborts the whole process, so it
is not used.) "required" or a named tool constrains the whole answer to the format.
"""

from __future__ import annotations

import hashlib
import json
import re

from localserve.api import call_forms
from localserve.api.reasoning import partial_tag
from localserve.models.answer_formats import NativeFormat, new_call_id


def openai_call(name: str, arguments: str, call_id: str | None = None) -> dict:
    """One tool call in OpenAI's shape, whichever format it was read from."""
    return {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


# ---- rendering --------------------------------------------------------------------------

def template_tools(tools) -> list[dict]:
    """OpenAI's tool list, as the templates read it."""
    return [{"type": "function", "function": {"name": t.function.name,
             "description": t.function.description or "", "parameters": t.function.parameters}}
            for t in tools]


def template_messages(messages, fmt: NativeFormat) -> list[dict]:
    """Chat messages with their tool calls and results kept as structure for the template
    (arguments as objects, which every template serialises itself)."""
    out = []
    for m in messages:
        plain = m.as_template_dict(native=True)
        if fmt.name.startswith("mistral"):  # its templates insist on 9-character ids
            plain = _short_ids(plain)
        out.append(plain)
    return out


def _short_ids(message: dict) -> dict:
    short = lambda i: i if len(i) == 9 and i.isalnum() else hashlib.sha1(i.encode()).hexdigest()[:9]  # noqa: E731
    if message.get("tool_call_id"):
        message = {**message, "tool_call_id": short(message["tool_call_id"])}
    if message.get("tool_calls"):
        message = {**message, "tool_calls": [{**c, "id": short(c["id"])} for c in message["tool_calls"]]}
    return message


# ---- the constrained form ("required" or a named tool) ------------------------------------

def call_schema(tools, fmt: NativeFormat) -> dict:
    calls = [{"type": "object", "properties": {fmt.name_key: {"const": t.function.name},
                                               fmt.args_key: t.function.parameters},
              "required": [fmt.name_key, fmt.args_key]} for t in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def wrap_grammar(call_gbnf: str, fmt: NativeFormat, most: int) -> str:
    """The whole answer in the format, around a converted JSON schema grammar (its `root`
    renamed): a list of 1..most calls, or 1..most blocks."""
    body = rename_rule(call_gbnf, "root", "tool-call")
    trigger = json.dumps(fmt.trigger)
    if fmt.as_list:
        more = f' ("," space tool-call){{0,{most - 1}}}' if most > 1 else ""
        root = f'root ::= {trigger} "[" space tool-call{more} "]" space'
        root += f" {json.dumps(fmt.close)}" if fmt.close else ""
    elif fmt.close:
        block = f'{trigger} space tool-call space {json.dumps(fmt.close)}'
        more = f' ("\\n" {block}){{0,{most - 1}}}' if most > 1 else ""
        root = f"root ::= {block}{more}"
    else:
        root = "root ::= tool-call"
    if "space ::=" not in body:
        body += '\nspace ::= | " " | "\\n"'
    return root + "\n" + body


def named_calls(tool_grammars: list[tuple[str, str]], between: str,
                head=None) -> tuple[str, list[str]]:
    """A call written as NAME, `between`, then its arguments' JSON (harmony's, Mistral's
    [ARGS] form, call_forms.NAMED's): (the alternatives over the tools, the rules they use).
    tool_grammars: (name, its JSON schema's GBNF with its `root`), each one's rules prefixed so
    none collide; `head(NAME, between)`, where given: how the call's name and `between` are
    written (else as one literal)."""
    rules, calls = [], []
    for i, (name, gbnf) in enumerate(tool_grammars):
        prefix = f"t{i}-"
        for defined in dict.fromkeys(re.findall(r"^([\w-]+)\s*::=", gbnf, re.MULTILINE)):
            gbnf = rename_rule(gbnf, defined, prefix + defined)
        rules.append(gbnf)
        written = head(name, between) if head else json.dumps(name + between)
        calls.append(f"{written} {prefix}root")
    return "(" + " | ".join(calls) + ")", rules


def args_grammar(tool_grammars: list[tuple[str, str]], fmt: NativeFormat, most: int) -> str:
    """Mistral's newer form, forced: 1..most of [TOOL_CALLS]NAME[ARGS]{...}."""
    calls, rules = named_calls(tool_grammars, "[ARGS]")
    one = f"{json.dumps(fmt.trigger)} {calls}"
    more = f" ({one}){{0,{most - 1}}}" if most > 1 else ""
    return "\n".join([f"root ::= {one}{more}", *rules])


LITERAL = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]')


def rename_rule(gbnf: str, old: str, new: str) -> str:
    """Rename a rule everywhere it is defined or used, never inside a literal or a class."""
    out, at = [], 0
    word = re.compile(rf"(?<![\w-]){re.escape(old)}(?![\w-])")
    for found in LITERAL.finditer(gbnf):
        out.append(word.sub(new, gbnf[at:found.start()]))
        out.append(found.group())
        at = found.end()
    out.append(word.sub(new, gbnf[at:]))
    return "".join(out)


# ---- reading an answer -----------------------------------------------------------------

def _first_trigger(text: str, fmt: NativeFormat) -> int:
    found = [i for i in (text.find(t) for t in (fmt.trigger, *fmt.triggers)) if i >= 0]
    return min(found) if found else -1


def parse(text: str, fmt: NativeFormat) -> tuple[str | None, list[dict]]:
    """(content, tool calls in OpenAI's shape). Calls that do not parse are left out; if none
    parses, the whole text is the content (what the model wrote, in its own words)."""
    start = _first_trigger(text, fmt)
    if start < 0:
        return text, []
    calls = [_openai_call(c, fmt) for c in _calls_in(text[start:], fmt)]
    calls = [c for c in calls if c is not None]
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls


def _calls_in(text: str, fmt: NativeFormat) -> list:
    """The call objects written from the trigger on (complete ones only)."""
    if fmt.name == "mistral-args":
        return [call for block in text.split(fmt.trigger)[1:]
                for call in [args_call(block)] if call is not None]
    if fmt.named:
        return call_forms.named_calls(text, call_forms.NAMED[fmt.named])
    if fmt.xml in ("invoke", "dsml"):
        return call_forms.invoke_calls(text, fmt.xml, tagged_value)
    if fmt.xml:  # one complete call per block
        return [call for block in text.split(fmt.trigger)[1:] if fmt.close in block
                for call in [xml_call(block.split(fmt.close)[0], fmt.xml)] if call is not None]
    if fmt.close:  # one object per block
        return [value for block in text.split(fmt.trigger)[1:]
                for value in json_values(block.split(fmt.close)[0])]
    for opening in fmt.triggers + ((fmt.trigger,) if fmt.as_list else ()):
        text = text.replace(opening, "")
    return json_values(text)


ARGS_CALL = re.compile(r"\s*([\w.-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\](.*)", re.DOTALL)


def args_call(block: str) -> dict | None:
    """Mistral's NAME[ARGS]{...} (Mistral Small 3.2 adds [CALL_ID]ID) as {"name", "arguments"
    (, "id")}; None for a block cut short."""
    found = ARGS_CALL.match(block)
    values = json_values(found.group(3)) if found else []
    if not values or not isinstance(values[0], dict):
        return None
    call = {"name": found.group(1), "arguments": values[0]}
    return {**call, "id": found.group(2)} if found.group(2) else call


XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


ARG_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def xml_call(block: str, style: str = "function") -> dict | None:
    """One tagged call (NativeFormat.xml's styles) as {"name", "arguments"}: each parameter's
    value as JSON where it reads as a number, boolean, null, object or list, else as text."""
    if style == "arg":  # GLM: the name first, then key and value pairs
        name, pairs = block.split("<arg_key>", 1)[0].strip(), ARG_PAIR.findall(block)
        if not name or "<" in name:
            return None
    else:
        found = XML_FUNCTION.search(block)
        if found is None:
            return None
        name, pairs = found.group(1).strip(), XML_PARAMETER.findall(found.group(2))
    return {"name": name, "arguments": {key.strip(): tagged_value(value) for key, value in pairs}}


def tagged_value(value: str):
    """A tagged parameter's value: JSON where it reads as a number, boolean, null, object or
    list, else the text itself."""
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return value if isinstance(parsed, str) else parsed


def xml_grammar(tools, fmt: NativeFormat, most: int) -> str:
    """The whole answer as 1..most calls in the XML form: each tool's required parameters in
    its schema's order, the others optional, each value as its schema types it (xml_value)."""
    if fmt.xml in ("invoke", "dsml"):
        return call_forms.invoke_grammar(tools, fmt.trigger, fmt.close, fmt.xml, most, xml_value)

    def parameter(key: str, typed: dict) -> str:
        value = xml_value(typed)
        if fmt.xml == "arg":
            return (f'{json.dumps(f"<arg_key>{key}</arg_key>")} "\\n" "<arg_value>" {value} '
                    f'"</arg_value>\\n"')
        return f'{json.dumps(f"<parameter={key}>")} "\\n" {value} "\\n</parameter>\\n"'

    rules, calls = [], []
    for i, tool in enumerate(tools):
        if fmt.xml == "arg":
            head, end = json.dumps(tool.function.name + "\n"), ""
        else:
            head, end = json.dumps(f"<function={tool.function.name}>\n"), ' "</function>"'
        rules.append(f'call-{i} ::= {head} {call_forms.parameters(tool, parameter)}{end}')
        calls.append(f"call-{i}")
    opening = "" if fmt.xml == "arg" else ' "\\n"'  # GLM writes the name right after the tag
    block = (f'{json.dumps(fmt.trigger)}{opening} ({" | ".join(calls)}) "\\n" '
             f'{json.dumps(fmt.close)}')
    more = f' ("\\n" {block}){{0,{most - 1}}}' if most > 1 else ""
    return "\n".join([f"root ::= {block}{more}", *rules, "xml-value ::= [^<]+"])


def typed_scalar(schema: dict, quote: str = "") -> str | None:
    """A value's grammar where its schema types it as a scalar: one of its enum's strings
    (between `quote`s), an integer, a number, a boolean; None for any other value."""
    enum = schema.get("enum")
    if enum and all(isinstance(v, str) and "<" not in v and v for v in enum):
        return "(" + " | ".join(json.dumps(quote + v + quote) for v in enum) + ")"
    return {"integer": '"-"? [0-9]{1,18}', "number": '"-"? [0-9]{1,18} ("." [0-9]{1,18})?',
            "boolean": '("true" | "false")'}.get(schema.get("type"))


def string_bound(schema: dict, least: int = 0) -> str:
    """How many characters a string value may have: {least,maxLength} where the schema bounds
    it, else any number (*)."""
    most = schema.get("maxLength")
    return f"{{{least},{most}}}" if isinstance(most, int) and least < most < 10_000 else "*"


def xml_value(schema: dict) -> str:
    """A parameter's value in the XML form, as its schema types it (typed_scalar), text of at
    most maxLength, else free text without a '<'."""
    if (scalar := typed_scalar(schema)) is not None:
        return scalar
    if schema.get("type") == "string" and string_bound(schema) != "*":
        return f"[^<]{string_bound(schema, least=1)}"
    return "xml-value"


def json_values(text: str) -> list:
    """The JSON values at the start of text, one after another (a list opens into its items;
    separators: whitespace , ;), up to the first that does not parse (a cut answer)."""
    decoder, found = json.JSONDecoder(), []
    text = text.strip()
    at = 1 if text.startswith("[") else 0
    while True:
        at = len(text) - len(text[at:].lstrip(" \t\n\r;,"))
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return found
        found.append(value)


def _openai_call(call, fmt: NativeFormat) -> dict | None:
    if not isinstance(call, dict) or not isinstance(call.get(fmt.name_key), str):
        return None
    args = call.get(fmt.args_key, call.get("arguments", {}))
    given = call.get("id")  # the model's own (Mistral's), where it wrote one
    return openai_call(call[fmt.name_key], args if isinstance(args, str) else json.dumps(args),
                       given if isinstance(given, str) and given else fmt.call_id())


class ProseThenCalls:
    """While an answer streams: the prose before the format's trigger goes out as it comes
    (a cut trigger held back until the next piece), everything from the trigger is held."""

    def __init__(self, fmt: NativeFormat):
        self.fmt, self.held, self.calling = fmt, "", False

    def feed(self, piece: str) -> str:
        if self.calling:
            self.held += piece
            return ""
        text = self.held + piece
        start = _first_trigger(text, self.fmt)
        if start >= 0:
            self.calling, self.held = True, text[start:]
            return text[:start]
        keep = max(partial_tag(text, t) for t in (self.fmt.trigger, *self.fmt.triggers))
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def finish(self) -> tuple[str | None, list[dict]]:
        """(prose still held, calls) once the answer is complete."""
        if not self.calling:
            return self.held or None, []
        content, calls = parse(self.held, self.fmt)
        return (None, calls) if calls else (content, [])
