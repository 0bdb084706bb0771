"""From a request body to prompt tokens, without letting one body stall the server.

Three rules, each closing a hole a colleague could use against the others:
- Only the chat template's own text is parsed for special tokens; message text never is
  (see chat_template.py), so nobody can forge a system or assistant turn.
- What could never fit a slot is refused before any rendering or tokenizing, by cheap
  counts: more messages than a slot has tokens, or more bytes than a slot's tokens could
  ever spell (no token is longer than the vocabulary's longest piece).
- Rendering and tokenizing run on a worker thread, so /health and every other request keep
  being answered while a large prompt is tokenized.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from localserve.models.chat_template import ChatTemplateError, PromptPart, as_alternating_turns
from localserve.api import images as image_input
from localserve.api.schemas import OpenAIError
from localserve.models.image_inputs import IMAGE_MARKER, ImageError, PlacedImages
from localserve.models.model_host import ModelHost

MEDIA_MARKER = "<__media__>"  # where llama-server's multimodal_data go (mtmd_default_marker)


def too_long(host: ModelHost, what: str, param: str, more: str = "") -> OpenAIError:
    """The one wording of a request that cannot fit: what it holds, what bounds one request
    (host.context_bound), and anything `more` that helps to shorten it."""
    return OpenAIError(400, f"This request's {what}, but {host.context_bound()}.{more} "
                       f"Shorten it.", code="context_length_exceeded", param=param)


def check_size(host: ModelHost, n_messages: int, n_bytes: int, param: str) -> None:
    """Refuse at once what no tokenization could fit into a slot."""
    n_ctx = host.n_ctx_per_slot
    if n_messages > n_ctx:
        raise too_long(host, f"{n_messages} messages need more than one token each", param)
    if n_bytes > n_ctx * host.max_piece_bytes:
        raise too_long(host, f"text is {n_bytes} bytes, more than "
                        f"{n_ctx} tokens of at most {host.max_piece_bytes} bytes can spell",
                        param)


def check_token_ids(host: ModelHost, ids: list[int], param: str) -> list[int]:
    """Token ids a caller sent: each must exist in the vocabulary (llama.cpp aborts on one that
    does not)."""
    n_vocab = host.n_vocab
    bad = [t for t in ids if not 0 <= t < n_vocab]
    if bad:
        raise OpenAIError(400, f"{param}: token ids out of range 0..{n_vocab - 1}: {bad[:5]}",
                          param=param)
    return list(ids)


async def text_or_ids(host: ModelHost, value: str | list[int], param: str) -> list[int]:
    """A completion prompt as text (tokenized) or as token ids (checked)."""
    if isinstance(value, str):
        return await text_prompt(host, value)
    return check_token_ids(host, value, param)


def check_reads_images(host: ModelHost, where: str) -> None:
    """An image sent to a text model: the 400 that names the model and the fix."""
    if not host.reads_images:
        raise OpenAIError(400, f"{where}: the model '{host.model_id}' reads text only; serve it "
                          f"with its projector (--mmproj FILE) to send images, or send text",
                          param=where)


async def media_prompt(host: ModelHost, text: str, data: list[str], param: str,
                       key: str | None) -> tuple[list[int], PlacedImages]:
    """llama-server's `{"prompt_string", "multimodal_data"}`: the caller's raw text (special
    tokens parsed, as text_prompt), each MEDIA_MARKER in it the next base64 image, decoded in
    `key`'s turn (images.decode_in_turn). (tokens, the images by hash)"""
    parts, refs = media_parts(host, text, data, param)
    decoded = await image_input.decode_in_turn(refs, key)
    return await run_in_threadpool(image_tokens, host, parts, decoded, param)


def media_parts(host: ModelHost, text: str, data: list,
                param: str) -> tuple[list[PromptPart], list]:
    """media_prompt's text as prompt parts (an image where each marker was) and its images
    (base64, or ImageRefs already made) as ImageRefs, checked (one marker each, a model that
    reads images, the text's size)."""
    pieces = text.split(MEDIA_MARKER)
    if len(pieces) - 1 != len(data):
        raise OpenAIError(400, f"{param}.prompt_string has {len(pieces) - 1} {MEDIA_MARKER} "
                          f"markers for {len(data)} items of multimodal_data; put one where "
                          f"each image goes", param=param)
    if data:
        check_reads_images(host, f"{param}.multimodal_data")
    check_size(host, 1, len(text.encode()), param)
    refs = [item if isinstance(item, image_input.ImageRef) else
            image_input.ImageRef(item, f"{param}.multimodal_data[{i}]")
            for i, item in enumerate(data)]
    parts = [PromptPart(pieces[0], trusted=True)]
    for piece in pieces[1:]:  # an image where each marker was (host.tokenize_parts)
        parts += [PromptPart(IMAGE_MARKER, trusted=False), PromptPart(piece, trusted=True)]
    return parts, refs


def image_tokens(host: ModelHost, parts: list, decoded: list, param: str,
                  answered: bool = True) -> tuple[list[int], PlacedImages]:
    """`answered`: a model answers from the prompt's last text token, so an answer's prompt
    may not end with an image (an embedding's input may)."""
    try:
        tokens, images = host.tokenize_parts(parts, decoded)
    except ImageError as exc:
        raise OpenAIError(400, str(exc), param=param) from None
    if answered and tokens and tokens[-1] < 0:  # an image's row: answers start from text
        raise OpenAIError(400, f"{param}: the prompt ends with an image; the model answers "
                          "from the text after it: add some (a question, or the template's "
                          "generation prompt)", param=param)
    return tokens, images


async def fill_in_the_middle(host: ModelHost, before: str, after: str, what: str, param: str,
                             middle: list[int] = ()) -> list[int]:
    """The model's fill-in-the-middle prompt: prefix token, the text before, suffix token,
    the text after, middle token (then what the middle starts with). Refused for a model
    without those tokens, saying that `what` cannot work with it."""
    fim = host.fim_tokens
    if fim is None:
        raise OpenAIError(400, f"the model '{host.model_id}' has no fill-in-the-middle tokens, "
                          f"so {what} cannot work with it; use a code model that has them "
                          f"(e.g. a Qwen2.5-Coder or CodeLlama GGUF)", param=param)
    prefix = await text_prompt(host, before) if before else []
    suffix = await text_prompt(host, after) if after else []
    return [fim[0], *prefix, fim[1], *suffix, fim[2], *middle]


def _chat_tokens(host: ModelHost, messages: list[dict], tools: list[dict] | None,
                 ending: str = "assistant", variables: dict | None = None,
                 images: list = ()) -> tuple[list[int], PlacedImages, str]:
    """ending: "assistant" (the template's generation prompt: a new answer), "none" (the
    messages as they are), "continue" (the final assistant message left open); variables:
    the request's chat_template_kwargs; images: the messages' images decoded, in order."""
    shape = {"add_generation_prompt": ending == "assistant", "continue_final": ending == "continue",
             "variables": variables}
    try:
        parts = host.template.render_parts(messages, tools=tools, **shape)
    except ChatTemplateError as exc:
        if tools or not any(m["role"] in ("system", "tool") for m in messages):
            raise OpenAIError(400, str(exc), param="messages")
        # a template that knows only alternating user/assistant turns (Gemma's): the system
        # text and tool results become the user's (the generic tool format puts its tools in
        # the system message, and its results come back with the tool role)
        try:
            parts = host.template.render_parts(as_alternating_turns(messages), **shape)
        except ChatTemplateError:
            raise OpenAIError(400, str(exc), param="messages") from None
    tail = parts[-1].text if parts and parts[-1].trusted else ""
    return (*image_tokens(host, parts, list(images), "messages"), tail)


async def chat_prompt(host: ModelHost, rendered: list[dict], tools: list[dict] | None = None,
                      ending: str = "assistant", variables: dict | None = None,
                      images: list = (),
                      key: str | None = None) -> tuple[list[int], PlacedImages, str]:
    """Messages already in template form (chat_message.ChatMessage.as_template_dict, plus any
    tool prompt); tools for a template that renders them itself; ending, variables: see
    _chat_tokens; images: the messages' ImageRefs, decoded in `key`'s turn
    (images.decode_in_turn). (tokens, the images placed among them by hash, the template's
    own text the prompt ends with: "" when a caller's text ends it)"""
    size = sum(len(m["content"].encode()) for m in rendered) + len(str(tools or "").encode())
    check_size(host, len(rendered), size, "messages")
    decoded = await image_input.decode_in_turn(list(images), key)
    return await run_in_threadpool(_chat_tokens, host, rendered, tools, ending, variables, decoded)


async def text_prompt(host: ModelHost, prompt: str) -> list[int]:
    """A raw completion prompt is the caller's own whole text (no one else's template), so its
    special tokens are parsed, as llama-server does; size and threading rules still apply."""
    check_size(host, 1, len(prompt.encode()), "prompt")
    return await run_in_threadpool(host.tokenize_prompt, prompt)
