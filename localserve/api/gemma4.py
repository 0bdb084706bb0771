"""Gemma 4's answer format, read as llama-server reads it: reasoning in a thought channel, then
the answer, with tool calls in Gemma's own dictionary syntax (keys bare, strings between
<|"|> quotes):

    <|channel>thought\nreasoning...<channel|>the answer
    <|tool_call>call:get_time{city:<|"|>Paris<|"|>,days:3}<tool_call|>

An empty or repeated thought channel and a stray <channel|> are no text (llama.cpp's edge
cases). The markers are control tokens, spelled out in the answer's text for such a model
(chat_template.answer_markers). With tool_choice "required" or a named tool the answer is
constrained to calls in this syntax, each value as its schema types it.
"""

from __future__ import annotations

import json
import re

from localserve.api.reasoning import partial_tag
from localserve.api.tool_formats import openai_call, string_bound, typed_scalar

OPEN, CLOSE, CALL, CALL_END, QUOTE = "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>'
MARKERS = (OPEN, CLOSE, CALL, CALL_END)
CALL_TEXT = re.compile(r"\s*call:([\w.-]+)\s*(\{.*\})\s*$", re.DOTALL)
KEY = re.compile(r"[A-Za-z_][\w-]*(?=\s*:)")


class GemmaReader:
    """feed(text) -> [("thought" | "text", text)] as the answer streams; `calls` at its end."""

    def __init__(self):
        self.held = ""
        self.state = "text"  # or "channel" (its name next), "thought", "call"
        self.calls: list[dict] = []
        self._call = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        text, self.held = self.held + text, ""
        while text:
            step = {"channel": self._channel, "call": self._in_call}.get(self.state, self._run)
            text = step(text, out)
        return [(kind, piece) for kind, piece in out if piece]

    def flush(self) -> list[tuple[str, str]]:
        held, self.held = self.held, ""
        if self.state in ("text", "thought") and held:
            return [(self.state, held)]
        return []

    def _run(self, text: str, out: list) -> str:
        """Text or thought up to the next marker; returns the text after it."""
        found = [(at, marker) for marker in MARKERS if (at := text.find(marker)) >= 0]
        if not found:
            keep = max(partial_tag(text, marker) for marker in MARKERS)
            out.append((self.state, text[:len(text) - keep]))
            self.held = text[len(text) - keep:]
            return ""
        at, marker = min(found)
        out.append((self.state, text[:at]))
        self.state = {OPEN: "channel", CLOSE: "text", CALL: "call"}.get(marker, self.state)
        self._call = ""
        return text[at + len(marker):]

    def _channel(self, text: str, out: list) -> str:
        """A channel's name (then one newline): "thought" is reasoning, any other text."""
        name = re.match(r"[a-z]*", text).group()
        if len(name) == len(text):  # the name may go on in the next piece
            self.held = text
            return ""
        rest = text[len(name):]
        self.state = "thought" if name == "thought" else "text"
        return rest[1:] if rest.startswith("\n") else rest

    def _in_call(self, text: str, out: list) -> str:
        self._call += text
        at = self._call.find(CALL_END)
        if at < 0:
            return ""
        call, rest = self._call[:at], self._call[at + len(CALL_END):]
        parsed = read_call(call)
        if parsed is not None:
            self.calls.append(parsed)
        self.state, self._call = "text", ""
        return rest


def read_call(text: str) -> dict | None:
    """`call:NAME{key:value,...}` as an OpenAI call (None when it does not parse)."""
    found = CALL_TEXT.match(text)
    if found is None:
        return None
    try:
        arguments = json.loads(as_json(found.group(2)))
    except ValueError:
        return None
    return openai_call(found.group(1), json.dumps(arguments))


def as_json(text: str) -> str:
    """Gemma's dictionary syntax as JSON: <|"|>-quoted strings as JSON strings, bare keys
    quoted; numbers, true, false, null, lists and objects as they are."""
    out, at = [], 0
    while at < len(text):
        if text.startswith(QUOTE, at):
            end = text.find(QUOTE, at + len(QUOTE))
            if end < 0:
                raise ValueError("an unclosed string")
            out.append(json.dumps(text[at + len(QUOTE):end]))
            at = end + len(QUOTE)
        elif (key := KEY.match(text, at)) is not None and text[at - 1:at] in ("{", ",", " ", ""):
            out.append(json.dumps(key.group()))
            at = key.end()
        else:
            out.append(text[at])
            at += 1
    return "".join(out)


# ---- the constrained form ("required" or a named tool) ------------------------------------

VALUES = r'''gv-value ::= gv-string | gv-number | "true" | "false" | "null" | gv-array | gv-object
gv-string ::= "<|\"|>" gv-char* "<|\"|>"
gv-char ::= [^<] | "<" [^|]
gv-number ::= "-"? [0-9]{1,18} ("." [0-9]{1,18})? ([eE] [-+]? [0-9]{1,3})?
gv-array ::= "[" (gv-value ("," gv-value)*)? "]"
gv-object ::= "{" (gv-key ":" gv-value ("," gv-key ":" gv-value)*)? "}"
gv-key ::= [A-Za-z_] [A-Za-z0-9_]*'''


def grammar(tools, most: int) -> str:
    """1..most calls, each `<|tool_call>call:NAME{...}<tool_call|>`: the required parameters
    in the schema's order, then the optional ones, each value as its schema types it."""
    calls = []
    for tool in tools:
        schema = tool.function.parameters or {}
        required = [k for k in schema.get("properties", {}) if k in schema.get("required", ())]
        optional = [k for k in schema.get("properties", {}) if k not in required]
        pair = lambda key: f'"{key}:" {typed(schema["properties"][key])}'  # noqa: E731
        if required:
            body = ' "," '.join(pair(k) for k in required) + "".join(
                f' ("," {pair(k)})?' for k in optional)
        else:  # any of them, in the schema's order or not
            keys = " | ".join(pair(k) for k in optional) or '""'
            body = f"(({keys}) (\",\" ({keys}))*)?"
        name = json.dumps(f"{CALL}call:{tool.function.name}{{")
        calls.append(f'{name} {body} "}}{CALL_END}"')
    one = "(" + " | ".join(calls) + ")"
    more = f" {one}{{0,{most - 1}}}" if most > 1 else ""
    return f"root ::= {one}{more}\n{VALUES}"


def typed(schema) -> str:
    """A value's grammar in Gemma's syntax, as its schema types it."""
    schema = schema if isinstance(schema, dict) else {}
    if (scalar := typed_scalar(schema, QUOTE)) is not None:
        return scalar
    if schema.get("type") == "string":
        return f'"<|\\"|>" gv-char{string_bound(schema)} "<|\\"|>"'
    return "gv-value"
