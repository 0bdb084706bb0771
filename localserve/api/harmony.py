"""gpt-oss's answer format (OpenAI's harmony), read as llama-server reads it: an answer is a run
of messages, each a header and a body,

    <|channel|>analysis<|message|>reasoning...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}
    <|start|>assistant<|channel|>final<|message|>the answer

(the recipient may also stand before the channel: ` to=functions.NAME<|channel|>...`). The
analysis channel is reasoning; final and commentary without a recipient are the answer; a
body sent to `functions.NAME` is a call of NAME with the body as its arguments; a body sent to
any other recipient (a built-in tool: `python`, `container.exec`) is nobody's: dropped, as
llama.cpp drops it. The markers are control tokens, spelled out in the answer's text for such a
model (ModelHost shows them: chat_template.ANSWER_MARKERS).

With tool_choice "required" or a named tool the whole answer is constrained to an optional
analysis message, then one call (the model ends its turn with <|call|> after it).
"""

from __future__ import annotations

import json
import re

from localserve.api.reasoning import partial_tag
from localserve.api.tool_formats import named_calls, openai_call

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
BODY_ENDS = (END, START, "<|call|>", "<|return|>")  # the last two end the turn (EOG)
RECIPIENT = re.compile(r"\bto=([^\s<]+)")
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
MAX_HEADER = 512  # characters: a longer "header" is the model writing plain text instead


class HarmonyReader:
    """feed(text) -> [("thought" | "text", text)] as the answer streams; calls() at its end:
    the function calls it made, in OpenAI's shape."""

    def __init__(self):
        self.held = ""  # a header being read, or a body's tail that may begin a marker
        self.header: str | None = ""  # None: inside a body
        self.kind = "text"  # the open body's: "thought", "text", "call" or "dropped"
        self.calls: list[dict] = []
        self._args: list[str] = []  # the open call's body so far
        self._name = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        text, self.held = self.held + text, ""
        while text:
            text = self._body(text, out) if self.header is None else self._head(text)
        return [(kind, piece) for kind, piece in out if piece]

    def flush(self) -> list[tuple[str, str]]:
        """The end of the answer: what is held is the open body's (a header never finished
        is plain text the model wrote)."""
        held, self.held = self.held, ""
        if self.header:
            return [("text", self.header + held)] if not self.header.startswith(("<|", " to=")) \
                else []
        out: list[tuple[str, str]] = []
        self._emit(held, out)
        self._close()
        return [(kind, piece) for kind, piece in out if piece]

    def _head(self, text: str) -> str:
        """Read a header up to <|message|>; returns the text after it (or nothing, held)."""
        self.header += text
        at = self.header.find(MESSAGE)
        if at < 0:
            if len(self.header) > MAX_HEADER and MESSAGE not in self.header:
                rest, self.header = self.header, None  # no header: the model writes plainly
                self.kind = "text"
                return rest
            return ""
        header, rest = self.header[:at], self.header[at + len(MESSAGE):]
        self.header = None
        self._open(header)
        return rest

    def _open(self, header: str) -> None:
        """A body's kind from its header: its recipient (`to=assistant` is the answer's own),
        else its last channel."""
        recipients = [r for r in RECIPIENT.findall(header) if r != "assistant"]
        channels = CHANNEL_NAME.findall(header)
        if recipients:
            self.kind = "call" if recipients[-1].startswith("functions.") else "dropped"
            self._name, self._args = recipients[-1].removeprefix("functions."), []
        else:
            self.kind = "thought" if channels and channels[-1] == "analysis" else "text"

    def _body(self, text: str, out: list) -> str:
        """Emit the open body up to its end marker; returns the text after it."""
        ends = [(at, marker) for marker in BODY_ENDS if (at := text.find(marker)) >= 0]
        if not ends:
            keep = max(partial_tag(text, marker) for marker in BODY_ENDS)
            self._emit(text[:len(text) - keep], out)
            self.held = text[len(text) - keep:]
            return ""
        at, marker = min(ends)
        self._emit(text[:at], out)
        self._close()
        self.header = ""
        return text[at + len(marker):] if marker != START else text[at:]

    def _emit(self, text: str, out: list) -> None:
        if self.kind == "call":
            self._args.append(text)
        elif self.kind != "dropped":
            out.append((self.kind, text))

    def _close(self) -> None:
        if self.kind == "call" and self._name:
            self.calls.append(_call(self._name, "".join(self._args)))
        self.kind, self._name, self._args = "text", "", []


def _call(name: str, body: str) -> dict:
    """OpenAI's call; the arguments as the model wrote them, compact JSON where they parse."""
    try:
        arguments = json.dumps(json.loads(body))
    except ValueError:
        arguments = body.strip()
    return openai_call(name, arguments)


def grammar(tool_grammars: list[tuple[str, str]]) -> str:
    """The forced answer: an optional analysis message, then one call of a tool, its body
    the tool's JSON schema grammar. tool_grammars: (name, that GBNF with its `root`)."""
    calls, rules = named_calls(tool_grammars, " <|constrain|>json" + MESSAGE)
    thought = f'"{CHANNEL}analysis{MESSAGE}" thought "{END}{START}assistant"'
    return "\n".join([f'root ::= ({thought})? "{CHANNEL}commentary to=functions." {calls}',
                      'thought ::= ([^<] | "<" [^|])*', *rules])
