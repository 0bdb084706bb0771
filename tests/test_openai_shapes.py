"""Every response and stream chunk held against the shapes OpenAI's API reference requires.

The schemas below are written here from the required fields and enums of the public API
reference (openai/openai-openapi: CreateChatCompletionResponse, CreateChatCompletionStream-
Response, CreateCompletionResponse, Model, ListModelsResponse, CreateEmbeddingResponse,
ChatCompletionTokenLogprob); they are a strict subset, not a copy. `refusal` must be present
(null is fine), as the reference requires and this server once omitted.
"""

import json

import httpx
import jsonschema
import pytest

NULLABLE_STR = {"type": ["string", "null"]}
TOP = {"type": "object", "required": ["token", "logprob", "bytes"],
       "properties": {"token": {"type": "string"}, "logprob": {"type": "number"},
                      "bytes": {"type": ["array", "null"], "items": {"type": "integer"}}}}
CHAT_LOGPROBS = {"type": ["object", "null"], "required": ["content"], "properties": {
    "content": {"type": ["array", "null"], "items": {**TOP, "required": TOP["required"] + ["top_logprobs"],
                                                     "properties": {**TOP["properties"], "top_logprobs": {
                                                         "type": "array", "items": TOP}}}}}}
TOOL_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name", "arguments"],
                 "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
         "properties": {k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens",
                                                         "total_tokens")}}


def envelope(obj: str, choice: dict) -> dict:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices"],
            "properties": {"id": {"type": "string"}, "object": {"const": obj},
                           "created": {"type": "integer"}, "model": {"type": "string"},
                           "system_fingerprint": NULLABLE_STR, "usage": {"anyOf": [USAGE, {"type": "null"}]},
                           "choices": {"type": "array", "items": choice}}}


CHAT = envelope("chat.completion", {
    "type": "object", "required": ["index", "message", "finish_reason", "logprobs"],
    "properties": {"index": {"type": "integer"},
                   "finish_reason": {"enum": ["stop", "length", "tool_calls", "content_filter",
                                              "function_call"]},
                   "logprobs": CHAT_LOGPROBS,
                   "message": {"type": "object", "required": ["role", "content", "refusal"],
                               "properties": {"role": {"const": "assistant"}, "content": NULLABLE_STR,
                                              "refusal": NULLABLE_STR,
                                              "tool_calls": {"type": "array", "items": TOOL_CALL}}}}})
CHUNK = envelope("chat.completion.chunk", {
    "type": "object", "required": ["index", "delta", "finish_reason"],
    "properties": {"index": {"type": "integer"}, "logprobs": CHAT_LOGPROBS,
                   "finish_reason": {"enum": [None, "stop", "length", "tool_calls", "content_filter",
                                              "function_call"]},
                   "delta": {"type": "object", "properties": {
                       "role": {"enum": ["assistant"]}, "content": NULLABLE_STR,
                       "tool_calls": {"type": "array", "items": {
                           "type": "object", "required": ["index"],
                           "properties": {"index": {"type": "integer"}, "id": {"type": "string"}}}}}}}})
COMPLETION = envelope("text_completion", {
    "type": "object", "required": ["index", "text", "logprobs", "finish_reason"],
    "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                   "finish_reason": {"enum": [None, "stop", "length", "content_filter"]},
                   "logprobs": {"type": ["object", "null"], "properties": {
                       "tokens": {"type": "array", "items": {"type": "string"}},
                       "token_logprobs": {"type": "array", "items": {"type": "number"}},
                       "top_logprobs": {"type": "array", "items": {"type": "object"}},
                       "text_offset": {"type": "array", "items": {"type": "integer"}}}}}})
MODEL = {"type": "object", "required": ["id", "object", "created", "owned_by"],
         "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                        "created": {"type": "integer"}, "owned_by": {"type": "string"}}}
MODELS = {"type": "object", "required": ["object", "data"],
          "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": MODEL}}}
EMBEDDINGS = {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
    "object": {"const": "list"}, "model": {"type": "string"},
    "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"]},
    "data": {"type": "array", "items": {"type": "object", "required": ["index", "embedding", "object"],
                                        "properties": {"object": {"const": "embedding"},
                                                       "index": {"type": "integer"}}}}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"]}}}


def chunks(url, path, body):
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


CHAT_BODIES = [
    {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6},
    {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "logprobs": True,
     "top_logprobs": 2, "stream_options": {"include_usage": True}},
    {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 60,
     "tools": [WEATHER], "tool_choice": "required"},
    {"messages": [{"role": "user", "content": "A person as JSON"}], "max_tokens": 60,
     "response_format": {"type": "json_object"}},
    {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "n": 2,
     "stream_options": {"include_usage": True}},
]


@pytest.mark.parametrize("body", CHAT_BODIES, ids=["plain", "logprobs", "tools", "json", "n=2"])
def test_chat_responses_and_chunks_have_the_reference_shape(server, body):
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    jsonschema.validate(whole, CHAT)
    for chunk in chunks(server.url, "/v1/chat/completions", body):
        jsonschema.validate(chunk, CHUNK)


def test_completions_models_and_embeddings_have_the_reference_shape(server):
    body = {"prompt": "1, 2, 3,", "max_tokens": 5, "logprobs": 2}
    jsonschema.validate(httpx.post(server.url + "/v1/completions", json=body, timeout=120).json(),
                        COMPLETION)
    for chunk in chunks(server.url, "/v1/completions", body):
        jsonschema.validate(chunk, COMPLETION)
    models = httpx.get(server.url + "/v1/models").json()
    jsonschema.validate(models, MODELS)
    jsonschema.validate(httpx.get(server.url + "/v1/models/" + models["data"][0]["id"]).json(), MODEL)
    jsonschema.validate(httpx.post(server.url + "/v1/embeddings", json={"input": ["a", "b"]}).json(),
                        EMBEDDINGS)
