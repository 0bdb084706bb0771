"""Render chat messages with the model's own Jinja2 template (GGUF `tokenizer.chat_template`).

Only the template's own text may become control tokens. So the template is rendered with
every message's content replaced by an unguessable placeholder, and the result is returned
as parts: the template's literal text (tokenized with special-token parsing on, so its
`<|im_start|>` markers become control tokens) and the callers' text (tokenized with it off,
so a user typing `<|im_start|>system` gets those characters, never the control token).
"""

from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import dataclass
from datetime import datetime

from jinja2 import TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used only when a GGUF carries no template: ChatML, the most common format.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# The control tokens an answer format is read by, spelled out in the answer's text
# (runner.show_specials) for a model whose template writes them: gpt-oss's harmony channels
# (api/harmony.py; <|return|> and <|call|> end the turn: never text) and Gemma 4's channels and
# calls (api/gemma4.py).
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>")
GEMMA4_MARKERS = ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>')

# llama.cpp's sample turns for reading a template's markers (common/chat-diff-analyzer.cpp)
SAMPLE_USER, SAMPLE_USER_TWO = "U_USER_MSG Hello END_U", "V_USER_MSG Hello END_V"
SAMPLE_ASSISTANT = "A_ASST_MSG I can help END_A"
SEGMENT = re.compile(r"(<[^>]*>|\[[^\]]*\])")  # a marker: <...> or [...]


def is_harmony(source: str | None) -> bool:
    """Does the template write gpt-oss's harmony channels?"""
    return "<|channel|>" in (source or "") and "<|message|>" in (source or "")


def is_gemma4(source: str | None) -> bool:
    """Does the template write Gemma 4's channels?"""
    return "<|channel>" in (source or "") and "<channel|>" in (source or "")


def answer_markers(source: str | None) -> tuple[str, ...]:
    """The control tokens this template's answers are read by (none for most)."""
    return HARMONY_MARKERS if is_harmony(source) else GEMMA4_MARKERS if is_gemma4(source) else ()


# Built-in formats `--chat-template NAME` selects instead of the GGUF's template (as llama-server's
# names do), for models whose file has none or a broken one.
BUILTIN = {
    "chatml": CHATML,
    "llama3": ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
               "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
               "{% endif %}"),
    "gemma": ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
              "{{ 'model' if m['role'] == 'assistant' else 'user' }}\n{{ m['content'] | trim }}"
              "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
              "{% endif %}"),
}


def override_source(name_or_jinja: str | None, file: str | None) -> str | None:
    """The template --chat-template / --chat-template-file choose (None: the GGUF's own):
    a built-in name, a Jinja template given inline, or a file's text."""
    if file:
        return open(file, encoding="utf-8").read()
    if name_or_jinja is None:
        return None
    if name_or_jinja in BUILTIN:
        return BUILTIN[name_or_jinja]
    return name_or_jinja  # Settings.validate let through only names and Jinja text


def fallback_for(architecture: str | None) -> tuple[str, str]:
    """(name, source) of the built-in template for a GGUF that carries none: its family's
    when the architecture says it (a Gemma file without a template still wants Gemma's
    turns), else ChatML, the most common format."""
    name = "gemma" if (architecture or "").startswith("gemma") else "chatml"
    return name, BUILTIN[name]


def as_alternating_turns(messages: list[dict]) -> list[dict]:
    """The messages for a template that knows only user and assistant turns, alternating
    (Gemma's): system text goes before the first user turn, tool results become the user's
    turns, and consecutive turns of one role are joined."""
    system = "\n\n".join(m.get("content") or "" for m in messages if m["role"] == "system")
    out: list[dict] = []
    for m in messages:
        if m["role"] == "system":
            continue
        if m["role"] == "tool":
            m = {"role": "user", "content": "Tool result: " + (m.get("content") or "")}
        if out and out[-1]["role"] == m["role"]:
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append(dict(m))
    if system:
        first = next((m for m in out if m["role"] == "user"), None)
        if first is None:
            out.insert(0, first := {"role": "user", "content": ""})
        first["content"] = system + ("\n\n" + first["content"] if first["content"] else "")
    return out


class ChatTemplateError(ValueError):
    """The messages could not be rendered (the template itself raised): a client error."""


# A marker the template's `| trim` filter went through (Gemma's and Llama 3's templates trim
# every message) stands for its caller text trimmed, as llama.cpp and Transformers render it.
TRIMMED = "t"
WHOLE_MARKER = re.compile("\ue000([0-9a-f]{16}-\\d{6})\ue001")


def trimmed(marker: str) -> str:
    return marker[:-1] + TRIMMED + "\ue001"


def _trim(value, chars: str | None = None) -> str:
    """Jinja's `trim`, for a caller's text hidden behind its marker as for any other string."""
    text = str(value)
    if chars is None and WHOLE_MARKER.fullmatch(text):
        return trimmed(text)
    return text.strip(chars)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None,
            sort_keys: bool = False) -> str:
    """Transformers' `tojson` (its keyword arguments; plain JSON, where Jinja's HTML-safe one
    would make every string added to it HTML-escaped: gpt-oss's `<|end|>` after a tool
    result). A caller's text hidden behind its marker comes out as the marker's JSON form
    (as_json), put back as the text's JSON string."""
    text = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)
    return QUOTED_MARKER.sub(lambda m: as_json("\ue000" + m.group(1) + "\ue001", ensure_ascii),
                             text)


# A marker as json.dumps writes it, with ensure_ascii or without
QUOTED_MARKER = re.compile(r'"(?:\ue000|\\ue000)([0-9a-f]{16}-\d+t?)(?:\ue001|\\ue001)"')


def as_json(marker: str, ensure_ascii: bool) -> str:
    """The marker standing for its caller text written as a JSON string."""
    return marker[:-1] + ("J" if ensure_ascii else "j") + "\ue001"


def _raise(message: str):
    raise ChatTemplateError(message)


class CallerText:
    """Every string a caller sent that a template may write raw, swapped for a marker before
    rendering and put back after as plain text (never parsed for special tokens): message
    content and reasoning_content, tool calls' arguments (a string, or every key and string of an object: templates
    write them raw, with `tojson`, or key by key), and chat_template_kwargs' string values (Llama
    3.x writes date_string raw). A forged "<|im_end|>" in any of them stays text."""

    def __init__(self):
        self.nonce = secrets.token_hex(8)
        self.contents: dict[str, str] = {}

    def text(self, value: str) -> str:
        marker = f"\ue000{self.nonce}-{len(self.contents):06d}\ue001"
        self.contents[marker] = value  # numbered by the entries so far: unique
        self.contents[trimmed(marker)] = value.strip()  # after the template's `| trim`
        # written with `| tojson` (Llama 3.1's and gpt-oss's tool results): the caller's text
        # goes there as a JSON string, as ensure_ascii asked
        for hidden, text in ((marker, value), (trimmed(marker), value.strip())):
            for ascii_only in (False, True):
                self.contents[as_json(hidden, ascii_only)] = json.dumps(text,
                                                                        ensure_ascii=ascii_only)
        return marker

    def tree(self, value):
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.tree(k): self.tree(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.tree(v) for v in value]
        return value

    def message(self, message: dict) -> dict:
        masked = {**message, "content": self.text(message.get("content") or "")}
        if message.get("reasoning_content"):
            masked["reasoning_content"] = self.text(message["reasoning_content"])
        if message.get("tool_calls"):
            masked["tool_calls"] = [self._call(call) for call in message["tool_calls"]]
        return masked

    def _call(self, call: dict) -> dict:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or "arguments" not in function:
            return call
        return {**call, "function": {**function, "arguments": self.tree(function["arguments"])}}


@dataclass(frozen=True)
class PromptPart:
    """A run of prompt text and who wrote it: the template (trusted) or a caller (plain text)."""

    text: str
    trusted: bool


class GenerationTag(Extension):
    """Transformers' `{% generation %}...{% endgeneration %}` (it marks the assistant's tokens
    for training; LFM2.5's and Laguna's templates use it): its body, rendered as written."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class TemplateSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, where a caller's text hidden behind its marker answers `.strip()` as
    `| trim` does (GLM's templates strip each message with the method), and a list may be
    used as a queue (`append`, `extend`, `pop`: Kimi K2's templates queue tool call ids in a
    namespace's list, as llama.cpp's template engine allows); nothing else changes a value."""

    def is_safe_attribute(self, obj, attr: str, value) -> bool:
        if isinstance(obj, list) and attr in ("append", "extend", "pop"):
            return True
        return super().is_safe_attribute(obj, attr, value)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
        owner = getattr(__obj, "__self__", None)
        asked = [name for name in kwargs if not name.startswith("_")]  # not Jinja's _loop_vars
        if (getattr(__obj, "__name__", "") == "strip" and isinstance(owner, str) and not args
                and not asked and WHOLE_MARKER.fullmatch(owner)):
            return trimmed(owner)
        return super().call(__context, __obj, *args, **kwargs)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        env = TemplateSandbox(trim_blocks=True, lstrip_blocks=True,
                              extensions=["jinja2.ext.loopcontrols", GenerationTag])
        env.globals["raise_exception"] = _raise
        env.filters["trim"] = _trim
        env.filters["tojson"] = _tojson
        # what llama.cpp's and Transformers' template environments give (Granite 3.3, Llama
        # 3.x write today's date with it)
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source or CHATML
        self.template = env.from_string(self.source)
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               continue_final: bool = False, tools: list[dict] | None = None) -> str:
        """The prompt as one string (for /apply-template-style display, not for tokenizing)."""
        return "".join(p.text for p in self.render_parts(messages, add_generation_prompt, tools,
                                                         continue_final=continue_final))

    def render_parts(self, messages: list[dict], add_generation_prompt: bool = True,
                     tools: list[dict] | None = None, continue_final: bool = False,
                     variables: dict | None = None) -> list[PromptPart]:
        """The prompt as template parts and caller parts, in order (see the module doc).
        continue_final: the last message (the assistant's) is left open, to be continued: the
        template's text after it (its end of turn) is cut."""
        masker = CallerText()
        masked = [masker.message(message) for message in messages]
        variables = {k: masker.text(v) if isinstance(v, str) else v
                     for k, v in (variables or {}).items()}
        nonce, contents = masker.nonce, masker.contents
        rendered = self._render(masked, add_generation_prompt and not continue_final, tools,
                                variables)
        if continue_final:
            rendered = self._open_last(rendered, masked[-1]["content"])
        parts = []
        pattern = re.compile("(\ue000" + nonce + r"-\d+" + TRIMMED + "?[jJ]?\ue001)")
        for piece in pattern.split(rendered):
            if piece in contents:
                if contents[piece]:
                    parts.append(PromptPart(contents[piece], trusted=False))
            elif piece:
                parts.append(PromptPart(piece, trusted=True))
        return parts

    def user_start_marker(self) -> str:
        """The text a user message starts with ("<|im_start|>user"), read as llama.cpp's
        autoparser reads it (detect_user_start_marker): what one user message adds to the
        render, before its content, leading end markers and blank text left out. Where
        sequences cannot be cut back, llama-server stops a prompt's batch there ("" if the
        template gives none)."""
        one = {"role": "user", "content": SAMPLE_USER}
        earlier = [{"role": "user", "content": SAMPLE_USER_TWO},
                   {"role": "assistant", "content": SAMPLE_ASSISTANT}]
        for before in ([], earlier):
            try:
                left, right = (self._render(m, False, variables={"enable_thinking": True})
                               for m in (before, before + [one]))
                break
            except ChatTemplateError:
                continue
        else:
            return ""
        left, right = (list(filter(None, SEGMENT.split(r))) for r in (left, right))
        start = len(os.path.commonprefix([left, right]))
        end = len(os.path.commonprefix([left[start:][::-1], right[start:][::-1]]))
        added = "".join(right[start:len(right) - end])
        added = added.split(SAMPLE_ASSISTANT)[-1].split(SAMPLE_USER)[0]
        kept, seen_marker = [], False
        for piece in filter(None, SEGMENT.split(added)):
            marker = SEGMENT.fullmatch(piece) is not None
            if not seen_marker and (any(w in piece.lower() for w in ("end", "close")) if marker
                                    else not piece.strip()):
                continue
            seen_marker |= marker
            kept.append(piece)
        return "".join(kept).strip()

    @staticmethod
    def _open_last(rendered: str, marker: str) -> str:
        at, marker = max((rendered.rfind(m), m) for m in (marker, trimmed(marker)))
        if at < 0:
            raise ChatTemplateError("this model's chat template does not write a final "
                                    "assistant message to continue")
        return rendered[:at + len(marker)]

    def _render(self, messages: list[dict], add_generation_prompt: bool,
                tools: list[dict] | None = None, variables: dict | None = None) -> str:
        extra = {**(variables or {}), **({"tools": tools} if tools else {})}  # tool_formats.py
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError, LookupError, AttributeError) as exc:
            # a template's own code failing on these messages (adding a dict to a string...)
            raise ChatTemplateError(f"the model's chat template failed on these messages: "
                                    f"{type(exc).__name__}: {exc}") from None
