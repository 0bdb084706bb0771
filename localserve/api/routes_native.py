"""llama-server's native API, for the clients and scripts written against it: POST /completion
(string or token prompt, n_predict, streaming without [DONE], timings, stop_type), /tokenize
and /detokenize (with_pieces), /apply-template, and /infill where the model has fill-in-the-
middle tokens. Same engine, keys, shares and limits as the OpenAI routes."""

from __future__ import annotations

import json
import time
from contextlib import aclosing
from typing import ClassVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from localserve.api import prompt, structured, tool_formats
from localserve.api.admission import Admitted, admit
from localserve.api.serving import submit
from localserve.api.answer import ChoiceReader, Failed, Finish, Text, read, whole_answer
from localserve.api.schemas import MAX_LOGPROBS, UNSUPPORTED, OpenAIError, PromptEnding, _Sampling
from localserve.engine.finish import FinishReason

router = APIRouter()


class NativeCompletion(_Sampling):
    refused: ClassVar[dict] = {k: v for k, v in UNSUPPORTED.items() if k != "n_probs"}

    prompt: str | list[int] = ""
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


async def _prompt_tokens(host, body: NativeCompletion) -> list[int]:
    if isinstance(body.prompt, list):
        return prompt.check_token_ids(host, body.prompt, "prompt")
    return await prompt.text_prompt(host, body.prompt)


async def _run(request: Request, admitted: Admitted, host, body: NativeCompletion,
               tokens: list[int]):
    if body.n != 1:
        raise OpenAIError(400, "llama-server's /completion returns one completion; for n > 1 "
                          "choices use /v1/completions", param="n")
    grammar = await run_in_threadpool(structured.request_grammar, host, body)
    stream = submit(admitted, host, tokens, body, grammar, request.url.path)
    started = time.monotonic()
    if body.stream:
        return EventSourceResponse(_sse(host, body, stream, started), sep="\n")
    answer = await whole_answer(stream, ChoiceReader(), request)
    final = _final(host, body, answer.text, answer.end, stream.requests[0], started)
    return {**final, **_probabilities(host, answer.logprobs, body)}


async def _sse(host, body, stream, started):
    async with aclosing(read(stream, [ChoiceReader()])) as pieces:
        async for _, piece in pieces:
            if isinstance(piece, Failed):
                yield {"data": json.dumps({"error": {"message": piece.error.message,
                                                     "code": piece.error.status}})}
                return
            if isinstance(piece, Text):
                chunk = {"content": piece.text, "stop": False, "id_slot": -1,
                         **_probabilities(host, list(piece.logprobs), body)}
                if body.return_tokens:
                    chunk["tokens"] = list(piece.token_ids)
                yield {"data": json.dumps(chunk)}
            elif isinstance(piece, Finish):
                yield {"data": json.dumps(_final(host, body, "", piece, stream.requests[0],
                                                 started))}


def _probabilities(host, found: list, body: NativeCompletion) -> dict:
    """llama-server's completion_probabilities for n_probs: each token with its top N."""
    if not body.n_probs:
        return {}

    def entry(token: int, logprob: float) -> dict:
        raw = host.runner.piece(token)
        return {"id": token, "token": raw.decode("utf-8", "replace"), "bytes": list(raw),
                "logprob": logprob}
    return {"completion_probabilities": [
        {**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}
        for token, logprob, top in found]}


def _final(host, body, text, end: Finish, engine_request, started) -> dict:
    now = time.monotonic()
    first = engine_request.first_token_time or now
    last, tokens_out = end.last, engine_request.output_tokens
    predicted = last.completion_tokens
    if last.finish_reason is FinishReason.LENGTH:
        stop_type = "limit"
    elif tokens_out and host.runner.is_eog(tokens_out[-1]):
        stop_type = "eos"
    else:
        stop_type = "word"
    decode_s = max(now - first, 1e-9)
    return {"content": text, "tokens": tokens_out if body.return_tokens else [],
            "id_slot": -1, "stop": True, "model": host.model_id,
            "tokens_predicted": predicted, "tokens_evaluated": last.prompt_tokens,
            "tokens_cached": last.cached_tokens, "truncated": False, "stop_type": stop_type,
            "stopping_word": "", "prompt": body.prompt if isinstance(body.prompt, str) else "",
            "timings": {"prompt_n": last.prompt_tokens - last.cached_tokens,
                        "prompt_ms": (first - started) * 1000, "predicted_n": predicted,
                        "predicted_ms": decode_s * 1000,
                        "predicted_per_second": predicted / decode_s if predicted else 0.0}}


@router.post("/completion")
@router.post("/completions")  # llama-server's alias; the OpenAI shape is /v1/completions
async def completion(body: NativeCompletion, request: Request,
                     admitted: Admitted = Depends(admit)):
    async with admitted.lease(body.model) as host:
        return await _run(request, admitted, host, body, await _prompt_tokens(host, body))


@router.post("/infill")
async def infill(body: Infill, request: Request,
                 admitted: Admitted = Depends(admit)):
    async with admitted.lease(body.model) as host:
        fim = host.runner.fim_tokens
        if fim is None:
            raise OpenAIError(400, f"the model '{host.model_id}' has no fill-in-the-middle "
                              f"tokens, so /infill cannot work with it; use a code model that has "
                              f"them (e.g. a Qwen2.5-Coder or CodeLlama GGUF)", param="model")
        prefix = await prompt.text_prompt(host, body.input_prefix) if body.input_prefix else []
        suffix = await prompt.text_prompt(host, body.input_suffix) if body.input_suffix else []
        middle = await _prompt_tokens(host, body) if body.prompt else []
        tokens = [fim[0], *prefix, fim[1], *suffix, fim[2], *middle]
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
        runner = host.runner

        def answer() -> JSONResponse:
            ids = runner.tokenize(body.content, body.add_special, body.parse_special)
            pieces = [_piece(runner, t) for t in ids] if body.with_pieces else ids
            return JSONResponse({"tokens": pieces})

        return await run_in_threadpool(answer)


def _piece(runner, token: int) -> dict:
    raw = runner.piece(token) or runner.token_text(token).encode()
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
        native = tool_formats.detect(host.template.source)  # tool history in its own words
        messages = (tool_formats.template_messages(body.messages, native) if native
                    else [m.as_template_dict() for m in body.messages])
        ending = body.ending
        try:
            return {"prompt": await run_in_threadpool(host.template.render, messages,
                                                      ending == "assistant", ending == "continue")}
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="messages") from None
