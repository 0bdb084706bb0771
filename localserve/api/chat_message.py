"""A chat message as clients send it (OpenAI's shape, which the other APIs translate to),
and the checks on what a chat template writes raw into the prompt: valid Unicode, tool names
and call ids that cannot forge a turn."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from localserve.models.image_inputs import IMAGE_MARKER


def valid_text(value: str, field: str) -> str:
    """Reject text that cannot be encoded as UTF-8 (an unpaired surrogate such as '\\ud800')."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{field} contains an unpaired UTF-16 surrogate at position {exc.start}; "
                         f"send valid Unicode text") from None
    return value


# What a tool's name and a call's id may hold: chat templates write both raw into the prompt
# (Qwen, Hermes, Llama 3.x, Mistral), so a name like `f<|im_end|>` would forge a turn there.
TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
CALL_ID = r"^[A-Za-z0-9_.:=+/-]{0,128}$"


class TextPart(BaseModel):
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _utf8(cls, value):
        return valid_text(value, "content")


class ImageURL(BaseModel):
    url: str
    detail: str | None = None  # OpenAI's low/high/auto: the projector decides the size here


class ImagePart(BaseModel):
    """OpenAI's image part; the other APIs' images are translated to it."""

    type: Literal["image_url"]
    image_url: ImageURL

    @field_validator("image_url", mode="before")
    @classmethod
    def _bare_url(cls, value):  # some clients send the address as a bare string
        return {"url": value} if isinstance(value, str) else value



ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]
READ_PARTS = ("text", "image_url")


def image_part(url: str) -> dict:
    """An image as OpenAI's content part: what every other API's image is translated to."""
    return {"type": "image_url", "image_url": {"url": url}}


def base64_image_part(media_type: str, data: str) -> dict:
    return image_part(f"data:{media_type};base64,{data}")


def joined_parts(parts: list[dict]):
    """Translated content parts as a string when they are all text (what every template
    reads), else the parts."""
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


class ToolCallFunction(BaseModel):
    name: str = Field(..., pattern=TOOL_NAME)  # an earlier call's, as a tool's name
    arguments: str


class ToolCall(BaseModel):
    id: str = Field(..., pattern=CALL_ID)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = Field(None, pattern=CALL_ID)  # a tool's result answers this call
    # an assistant's earlier reasoning (llama-server's field; Messages' thinking blocks): the
    # templates that keep reasoning in a tool loop (Qwen 3, Command R7B) render it
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value):
        """Say plainly that audio and files are not read (instead of a union error)."""
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in READ_PARTS:
                    raise ValueError(f"content parts of type {kind!r} are not supported: this "
                                     f"server reads text and images; send the text as a string "
                                     f"or as {{'type': 'text', 'text': ...}} parts")
        return value

    @field_validator("content", "reasoning_content")
    @classmethod
    def _utf8(cls, value, info):
        return valid_text(value, info.field_name) if isinstance(value, str) else value

    def _with_reasoning(self, out: dict) -> dict:
        return {**out, "reasoning_content": self.reasoning_content} if self.reasoning_content \
            else out

    @property
    def text(self) -> str:
        """The content as one text (text parts joined, each image as IMAGE_MARKER; none: "")."""
        content = self.content
        if not isinstance(content, list):
            return content or ""
        return "".join(p.text if isinstance(p, TextPart) else IMAGE_MARKER for p in content)

    def image_urls(self, where: str) -> list[tuple[str, str]]:
        """The message's images in order, as (url, the field it came in); `where` names the
        message."""
        if not isinstance(self.content, list):
            return []
        return [(p.image_url.url, f"{where}.content[{j}]")
                for j, p in enumerate(self.content) if isinstance(p, ImagePart)]

    def as_template_dict(self, native: bool = False) -> dict:
        """The message as the chat template reads it. Tool calls: written into the text in
        the generic JSON format (structured.py), or kept as structure for a template that
        renders them itself (native: tool_formats.py)."""
        content = self.text
        role = "system" if self.role == "developer" else self.role
        if native:
            out = {"role": role, "content": content or ""}
            if self.tool_calls:
                out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                    for c in self.tool_calls]
            if self.tool_call_id:
                out["tool_call_id"] = self.tool_call_id
            return self._with_reasoning(out)
        if self.tool_calls:  # the generic tool format (structured.py): the calls as JSON
            calls = [{"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}
                     for c in self.tool_calls]
            content = (content or "") + json.dumps({"tool_calls": calls})
        return self._with_reasoning({"role": role, "content": content or ""})


def _json_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments

