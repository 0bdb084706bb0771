"""Embedding requests, after admission: their inputs read (OpenAI's and llama-server's shapes)
and checked, then embedded by the model's service (models/embeddings.py: one input at a time,
keys taking turns, billed). Shared by OpenAI's /v1/embeddings and Ollama's /api/embed and
/api/embeddings."""

from __future__ import annotations

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from localserve.api.admission import Admitted
from localserve.api.chat_message import valid_text
from localserve.api.image_fetch import fetch_images
from localserve.api.images import decode_in_turn, from_url
from localserve.api.prompt import (MEDIA_MARKER, check_size, check_token_ids, image_tokens,
                                   media_parts)
from localserve.api.schemas import OpenAIError
from localserve.models.embeddings import ClientGone

MAX_INPUTS = 256


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    # OpenAI's shapes, and llama-server's: token ids with text mixed in, objects (_prompts)
    input: str | dict | list[int | str | list[int | str] | dict] | None = None
    content: str | dict | list[int | str | list[int | str] | dict] | None = None  # llama-
    # server's /embeddings name for `input`
    model: str | None = None
    encoding_format: str = Field("float", pattern="^(float|base64)$")
    dimensions: int | None = None  # the first N of each vector, normalised again
    user: str | None = None


def shortened(vector: list[float], dimensions: int | None) -> list[float]:
    """The first `dimensions` values, scaled back to unit length (OpenAI's and Ollama's
    `dimensions`: what they do for models trained to be cut, and Ollama for any)."""
    if dimensions is None:
        return vector
    cut = vector[:dimensions]
    norm = sum(x * x for x in cut) ** 0.5
    return [x / norm for x in cut] if norm > 0 else cut


def _raw_inputs(body: EmbeddingRequest) -> list:
    raw = _prompts(body.input if body.input is not None else body.content)
    if not raw or len(raw) > MAX_INPUTS:
        raise OpenAIError(400, f"send 1 to {MAX_INPUTS} inputs", param="input")
    return raw


def _inputs(host, raw: list, truncate: bool,
            pictured: dict[int, tuple]) -> list[tuple[list[int], dict]]:
    """Each input's tokens and the images placed among them (`pictured`: those with images,
    already read: _pictured)."""
    most = host.n_ctx_embedding
    out = [pictured[i] if i in pictured else (_tokens(host, item, f"input[{i}]", truncate), {})
           for i, item in enumerate(raw)]
    for i, (tokens, _) in enumerate(out):
        if not 0 < len(tokens) <= most:
            raise OpenAIError(400, f"input[{i}] is {len(tokens)} tokens; each must be 1 to "
                              f"{most}", code="context_length_exceeded", param="input")
    return out


async def _pictured(host, raw: list, key: str | None) -> dict[int, tuple]:
    """The inputs with images, by index: their tokens and images (llama-server's
    `{prompt_string, multimodal_data}`, or `{content: [parts]}` with image parts). The
    request's images are decoded together in the key's turn, bounded together as a chat's
    (api/images.py), then placed by the projector. An input may end with an image. Only where
    the last token pools (a chat model's embeddings)."""
    placed = []
    for i, item in enumerate(raw):
        media = _media(host, item, f"input[{i}]") if isinstance(item, dict) else None
        if media is not None:
            if host.kind == "embedding" or not host.reads_images:
                raise OpenAIError(400, f"input[{i}]: the model '{host.model_id}' reads text "
                                  f"only; embed images with a chat model served with its "
                                  f"projector (--mmproj FILE), or send text", param="input")
            placed.append((i, *media_parts(host, *media, f"input[{i}]")))
    refs = await fetch_images([ref for _, _, refs in placed for ref in refs],
                              host.settings.image_url_hosts, key)  # where addresses are allowed
    decoded = await decode_in_turn(refs, key)
    pictured = {}
    for i, parts, refs in placed:
        mine, decoded = decoded[:len(refs)], decoded[len(refs):]
        pictured[i] = await run_in_threadpool(image_tokens, host, parts, mine, f"input[{i}]",
                                              False)
    return pictured


def _media(host, item: dict, where: str) -> tuple[str, list] | None:
    """An object input's text (each image where MEDIA_MARKER is) and its images (base64, or
    an image_url part's ImageRef), or None where it has no image."""
    if isinstance(item.get("multimodal_data"), list) and item["multimodal_data"]:
        if not isinstance(item.get("prompt_string"), str) or not all(
                isinstance(d, str) for d in item["multimodal_data"]):
            raise OpenAIError(400, f"{where}: multimodal_data goes with a prompt_string, "
                              f"each item base64", param="input")
        return item["prompt_string"], item["multimodal_data"]
    parts = item.get("content")
    if not isinstance(parts, list) or not any(
            isinstance(p, dict) and p.get("type") == "image_url" for p in parts):
        return None
    text, data = "", []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text += part["text"]
        elif kind == "image_url" and isinstance(part.get("image_url"), dict) and \
                isinstance(part["image_url"].get("url"), str):
            text += MEDIA_MARKER
            data.append(from_url(part["image_url"]["url"], f"{where}.content[{j}]",
                                 host.settings.image_urls))
        else:
            raise OpenAIError(400, f"{where}.content[{j}]: a part of type text, or image_url "
                              f"with its url", param="input")
    return text, data


def _prompts(raw) -> list:
    """The inputs, as llama-server reads `input`: a string or an object is one; a list of
    token ids (strings mixed in are tokenized in place) is one; any other list is one input
    per element (strings, token lists, objects, mixed)."""
    if isinstance(raw, (str, dict)):
        return [raw]
    if raw and all(isinstance(x, (int, str)) for x in raw) and any(isinstance(x, int) for x in raw):
        return [raw]
    return raw


def _tokens(host, item, where: str, truncate: bool) -> list[int]:
    """One input's tokens; `truncate` (Ollama's): cut to what one input may hold."""
    most = host.n_ctx_embedding
    if isinstance(item, dict):
        item = _object_text(item, where)
    if isinstance(item, str):
        try:
            text = valid_text(item, where).encode()
        except ValueError as exc:  # an unpaired surrogate
            raise OpenAIError(400, str(exc), param="input") from None
        if truncate:  # no more than `most` tokens could spell, then `most` tokens
            text = text[:(most + 1) * host.max_piece_bytes]
        check_size(host, 1, len(text), where)
        tokens = host.tokenize(text.decode("utf-8", "ignore"), add_special=True, parse_special=False)
    elif isinstance(item, list) and all(isinstance(x, (int, str)) for x in item):
        tokens = []
        try:
            for part in item:  # token ids, with text spliced in (llama-server's mixed prompt)
                tokens += [part] if isinstance(part, int) else host.tokenize(
                    valid_text(part, where), add_special=False, parse_special=False)
        except ValueError as exc:  # an unpaired surrogate
            raise OpenAIError(400, str(exc), param="input") from None
        tokens = check_token_ids(host, tokens, where)
    else:
        raise OpenAIError(400, f"{where}: a string, a list of token ids (strings mixed in), or "
                          f"an object with prompt_string or text content", param="input")
    return tokens[:most] if truncate else tokens


def _object_text(item: dict, where: str) -> str:
    """llama-server's object inputs: {"prompt_string": text} or {"content": [text parts]}."""
    if isinstance(item.get("prompt_string"), str):
        return item["prompt_string"]
    parts = item.get("content")
    if not isinstance(parts, list) or not parts:
        raise OpenAIError(400, f"{where}: an object input needs prompt_string, or content as a "
                          f"list of parts", param="input")
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise OpenAIError(400, f"{where}: content parts must be of type text", param="input")
    return "".join(part["text"] for part in parts)


async def embed(request: Request, admitted: Admitted, host, body: EmbeddingRequest,
                endpoint: str, truncate: bool = False) -> tuple[list[list[float]], int]:
    """(a vector per input, the tokens embedded), billed to the caller like any answer
    (models/embeddings.py). `truncate` (Ollama's): a long input is cut to fit, not refused."""
    if body.dimensions is not None and not 0 < body.dimensions <= host.n_embd:
        raise OpenAIError(400, f"dimensions: 1 to {host.n_embd} (this model's vectors "
                          f"have {host.n_embd}), not {body.dimensions}", param="dimensions")
    raw = _raw_inputs(body)
    pictured = await _pictured(host, raw, admitted.user(body))
    try:
        vectors, n_tokens = await host.embeddings.embed(
            admitted.user(body), endpoint, lambda: _inputs(host, raw, truncate, pictured),
            request.is_disconnected)
    except ClientGone as exc:
        raise OpenAIError(499, str(exc), code="client_closed") from None
    return [shortened(v, body.dimensions) for v in vectors], n_tokens
