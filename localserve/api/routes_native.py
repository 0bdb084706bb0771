"""llama-server's native API, for the clients and scripts written against it: POST /completion
(string or token prompt, images as multimodal_data, n_predict, streaming without [DONE],
timings, stop_type), /tokenize and /detokenize (with_pieces), /apply-template, and /infill
where the model has fill-in-the-middle tokens. Same engine, keys, shares and limits as the
OpenAI routes."""

from __future__ import annotations

from typing import ClassVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from localserve.api import prompt, structured, tool_formats
from localserve.api.admission import Admitted, admit
from localserve.api.serving import submit
from localserve.api.native_reply import NativeReply
from localserve.api.replies import respond_with
from localserve.models import answer_formats
from localserve.models.image_inputs import IMAGE_MARKER, PlacedImages
from localserve.api.schemas import (MAX_LOGPROBS, UNSUPPORTED, ChatCompletionRequest, OpenAIError,
                                    PromptEnding, SamplingBody, Tool)

router = APIRouter()


class MediaPrompt(BaseModel):
    """llama-server's prompt with images: each <__media__> in the text is the next item of
    multimodal_data (base64 image files)."""
    model_config = ConfigDict(extra="forbid")

    prompt_string: str
    multimodal_data: list[str] = []


class NativeCompletion(SamplingBody):
    refused: ClassVar[dict] = {k: v for k, v in UNSUPPORTED.items() if k != "n_probs"}

    prompt: str | list[int] | MediaPrompt = ""
    n_predict: int = Field(-1, ge=-1)  # -1: until the slot is full or the model stops
    n_probs: int = Field(0, ge=0, le=MAX_LOGPROBS)  # each token's top N in completion_probabilities
    cache_prompt: bool = True  # always on here; accepted for compatibility
    return_tokens: bool = False

    @property
    def token_limit(self) -> int | None:
        return None if self.n_predict < 0 else max(self.n_predict, 1)

    @property
    def logprob_n(self) -> int | None:
        return self.n_probs or None


class Infill(NativeCompletion):
    input_prefix: str = ""
    input_suffix: str = ""


class TokenizeBody(BaseModel):
    model: str | None = None  # with several models: whose vocabulary (default: the default model)
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeBody(BaseModel):
    model: str | None = None
    tokens: list[int]


class TemplateBody(PromptEnding):
    model: str | None = None
    tools: list[Tool] | None = None  # shown as the model is shown them (its format's, or ours)


async def _run(request: Request, admitted: Admitted, host, body: NativeCompletion,
               tokens: list[int], images: PlacedImages | None = None):
    if body.n != 1:
        raise OpenAIError(400, "llama-server's /completion returns one completion; for n > 1 "
                          "choices use /v1/completions", param="n")
    grammar = await run_in_threadpool(structured.request_grammar, host, body)
    stream = submit(admitted, host, tokens, body, grammar, request.url.path, images=images)
    reply = NativeReply(host.model_id, body, host.piece)
    return await respond_with(reply.collect, reply.events, stream, request, body.stream, None)


@router.post("/completion")
@router.post("/completions")  # llama-server's alias; the OpenAI shape is /v1/completions
async def completion(body: NativeCompletion, request: Request,
                     admitted: Admitted = Depends(admit)):
    async with admitted.lease(body.model) as host:
        if isinstance(body.prompt, MediaPrompt):
            tokens, images = await prompt.media_prompt(
                host, body.prompt.prompt_string, body.prompt.multimodal_data, "prompt",
                admitted.caller.key)
            return await _run(request, admitted, host, body, tokens, images)
        tokens = await prompt.text_or_ids(host, body.prompt, "prompt")
        return await _run(request, admitted, host, body, tokens)


@router.post("/infill")
async def infill(body: Infill, request: Request,
                 admitted: Admitted = Depends(admit)):
    if isinstance(body.prompt, MediaPrompt):  # the shape /completion takes, not /infill
        raise OpenAIError(400, "prompt: /infill takes text or token ids, not a prompt with "
                          "images (send those to /completion)", param="prompt")
    async with admitted.lease(body.model) as host:
        middle = await prompt.text_or_ids(host, body.prompt, "prompt") if body.prompt else []
        tokens = await prompt.fill_in_the_middle(host, body.input_prefix, body.input_suffix,
                                                 "/infill", "model", middle)
        return await _run(request, admitted, host, body, tokens)


@router.post("/tokenize")
async def tokenize(body: TokenizeBody, request: Request,
                   admitted: Admitted = Depends(admit)):
    """All of it on a worker thread, the JSON too: a large text's ids and pieces must not
    stall the event loop (everyone's /health and streams)."""
    try:
        n_bytes = len(body.content.encode())
    except UnicodeEncodeError:
        raise OpenAIError(400, "content is not text: it holds a lone UTF-16 surrogate",
                          param="content") from None
    async with admitted.lease(body.model) as host:
        prompt.check_size(host, 1, n_bytes, "content")
        def answer() -> JSONResponse:
            ids = host.tokenize(body.content, body.add_special, body.parse_special)
            pieces = [_piece(host, t) for t in ids] if body.with_pieces else ids
            return JSONResponse({"tokens": pieces})

        return await run_in_threadpool(answer)


def _piece(host, token: int) -> dict:
    raw = host.piece(token) or host.token_text(token).encode()
    try:
        return {"id": token, "piece": raw.decode("utf-8")}
    except UnicodeDecodeError:
        return {"id": token, "piece": list(raw)}


@router.post("/detokenize")
async def detokenize(body: DetokenizeBody, request: Request,
                     admitted: Admitted = Depends(admit)):
    """On a worker thread, like /tokenize (800k ids take a second and more to check)."""
    async with admitted.lease(body.model) as host:
        def answer() -> JSONResponse:
            tokens = prompt.check_token_ids(host, body.tokens, "tokens")
            return JSONResponse({"content": host.detokenize(tokens)})

        return await run_in_threadpool(answer)


@router.post("/apply-template")
async def apply_template(body: TemplateBody, request: Request,
                         admitted: Admitted = Depends(admit)):
    async with admitted.lease(body.model) as host:
        native = answer_formats.detect(host.template_source)  # tool history in its own words
        messages = (tool_formats.template_messages(body.messages, native) if native
                    else [m.as_template_dict() for m in body.messages])
        tools = None
        if body.tools:  # the prompt a chat with these tools gets (serving.chat_tokens)
            chat = ChatCompletionRequest(messages=body.messages, tools=body.tools)
            messages, _, plan = await run_in_threadpool(structured.tool_setup, host, chat)
            tools = plan.template_tools
        ending = body.ending
        try:
            text = await run_in_threadpool(host.template.render, messages, ending == "assistant",
                                           ending == "continue", tools)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="messages") from None
    # each image where llama-server shows it: the server's own marker stays unknown to clients
    return {"prompt": text.replace(IMAGE_MARKER, prompt.MEDIA_MARKER)}
