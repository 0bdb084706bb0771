"""Reasoning separated from the answer: what a reasoning model writes inside <think>...</think>
(Mistral's reasoning models: [THINK]...[/THINK]) before its answer goes to `reasoning_content` (chat), `thinking` blocks (Messages) or a
reasoning item (Responses), never into the answer's text, as llama-server's
`--reasoning-format` does.

Only a block at the very start of the answer counts (after whitespace): a <think> written later
is part of the answer. The text is split as it streams; a tag cut between two pieces is held
back until the next piece says what it is.
"""

from __future__ import annotations

from localserve.models.chat_template import is_gemma4, is_harmony

OPEN, CLOSE = "<think>", "</think>"


HARMONY = "harmony"  # gpt-oss's channels (harmony.py)
GEMMA4 = "gemma4"  # Gemma 4's thought channel (gemma4.py)
THINK = "think"  # a leading <think> block
MISTRAL_THINK = "mistral-think"  # a leading [THINK] block (Magistral, Ministral 3 Reasoning)
APRIEL = "apriel"  # Apriel 1.6 Thinker: its prompt opens the steps, a marker ends them
TAGS = {THINK: (OPEN, CLOSE), MISTRAL_THINK: ("[THINK]", "[/THINK]"),
        APRIEL: ("Here are my reasoning steps:", "[BEGIN FINAL RESPONSE]")}


def reasoning_kind(format_: str, template_source: str | None) -> str:
    """How answers carry reasoning to split off ("" for none), by --reasoning-format: auto
    splits harmony or Gemma 4 channels or <think> blocks where the chat template writes them,
    deepseek always splits <think>, none never splits."""
    if format_ == "none":
        return ""
    if format_ == "auto" and is_harmony(template_source):
        return HARMONY
    if format_ == "auto" and is_gemma4(template_source):
        return GEMMA4
    if format_ == "auto" and "[THINK]" in (template_source or ""):
        return MISTRAL_THINK
    if format_ == "auto" and TAGS[APRIEL][1] in (template_source or ""):
        return APRIEL
    return THINK if format_ == "deepseek" or OPEN in (template_source or "") else ""


def opens_reasoning(kind: str, template_tail: str) -> bool:
    """Does the prompt end inside a reasoning block its template opened (Qwen3.5's, DeepSeek R1
    distills', GLM 4.7's generation prompt ends with <think>): the answer then starts as
    reasoning, without the tag."""
    return kind in TAGS and template_tail.rstrip().endswith(TAGS[kind][0])


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of text could be the start of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkSplitter:
    """feed(piece) -> (reasoning, answer) text of one streamed piece; flush() at the end.
    `kind`: whose tags (TAGS)."""

    def __init__(self, kind: str = THINK):
        self.open, self.close = TAGS.get(kind, TAGS[THINK])
        self.state = "start"  # -> "reasoning" -> "answer"; or "start" -> "answer"
        self.held = ""
        self.after_close = False  # strip the blank lines a model writes after </think>

    def feed(self, piece: str) -> tuple[str, str]:
        text, self.held = self.held + piece, ""
        if self.state == "start":
            stripped = text.lstrip()
            if stripped.startswith(self.open):
                self.state, text = "reasoning", stripped[len(self.open):]
            elif self.open.startswith(stripped):  # nothing yet, or a cut "<thi"
                self.held = text
                return "", ""
            else:
                self.state = "answer"
        if self.state == "reasoning":
            at = text.find(self.close)
            if at < 0:
                keep = partial_tag(text, self.close)
                self.held = text[len(text) - keep:]
                return text[:len(text) - keep], ""
            self.state, self.after_close = "answer", True
            return text[:at], self._answer(text[at + len(self.close):])
        return "", self._answer(text)

    def _answer(self, text: str) -> str:
        if self.after_close:
            text = text.lstrip()
            self.after_close = not text
        return text

    def opened(self) -> None:
        """The prompt opened the block (its template's generation prompt ends with the open
        tag): before anything is read, the answer starts as reasoning."""
        if self.state == "start" and not self.held:
            self.state = "reasoning"

    def flush(self) -> tuple[str, str]:
        """What is held back when the answer ends: an unclosed block stays reasoning."""
        held, self.held = self.held, ""
        return (held, "") if self.state == "reasoning" else ("", held)


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, answer) of a whole text."""
    splitter = ThinkSplitter()
    first, second = splitter.feed(text), splitter.flush()
    return first[0] + second[0], first[1] + second[1]
