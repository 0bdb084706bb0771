"""OpenAI request bodies (validated with pydantic) and the error body every failure uses."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from localserve.api.chat_message import TOOL_NAME, ChatMessage, valid_text

MAX_STOP_STRINGS = 16
MAX_TOKENS_LIMIT = 1_000_000  # beyond any context: a number this large is a client bug


class OpenAIError(Exception):
    """Raised anywhere in a handler; rendered as {"error": {...}} with its HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict | None = None,
                 delay_s: float = 0.0):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers
        self.delay_s = delay_s  # answered only after this long: a refusal sent again and
        # again costs its sender the wait, not the server its CPU (app.py)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


# Fields of OpenAI's or llama-server's API that would change the answer and that this server
# does not implement, with the values that are harmless: anything else is a 400 naming the
# field, never silently ignored. (Fields nobody defines are ignored and listed back in the
# response header X-Ignored-Fields.)
UNSUPPORTED = {
    "functions": (None, []), "function_call": (None, "none"), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,),
    "web_search_options": (None,), "n_probs": (None, 0), "tfs_z": (None, 1, 1.0),
    "dry_multiplier": (None, 0, 0.0),
    "xtc_probability": (None, 0, 0.0), "samplers": (None,), "lora": (None, []),
    "suffix": (None, ""), "best_of": (None, 1),
}


# llama-server's sampling extensions, which the Messages and Responses adapters pass on to the
# chat request they become (as llama-server does) instead of ignoring them.
EXTENSIONS = ("grammar", "json_schema", "seed", "min_p", "typical_p", "mirostat", "mirostat_tau",
              "mirostat_eta", "repeat_penalty", "repeat_last_n", "presence_penalty",
              "frequency_penalty", "logit_bias", "ignore_eos")


def extensions(extra: dict | None, names: tuple[str, ...] = EXTENSIONS) -> dict:
    """The extension fields (`names`) among a request's undeclared ones."""
    return {name: value for name, value in (extra or {}).items() if name in names}


class JsonSchemaFormat(BaseModel):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    # llama-server's extension: {"type": "json_object", "schema": {...}} follows the schema
    schema_: dict | None = Field(None, alias="schema")


class ToolFunction(BaseModel):
    name: str = Field(..., pattern=TOOL_NAME)
    description: str | None = Field(None, max_length=4096)
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: ToolFunction


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class SamplingBody(BaseModel):
    """Fields shared by chat and text completions (OpenAI names plus llama-server's extras)."""

    model_config = ConfigDict(extra="allow")

    refused: ClassVar[dict] = UNSUPPORTED  # a route that implements one of them narrows it

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if isinstance(data, dict):
            for name, harmless in cls.refused.items():
                if name in data and data[name] not in harmless:
                    raise OpenAIError(400, f"'{name}' is not supported by this server; send the "
                                      f"request without it (see the README's list)", param=name)
        return data

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    @property
    def token_limit(self) -> int | None:
        """The most the answer may be, from each shape's own fields (max_tokens here;
        max_completion_tokens, n_predict); None: no bound sent."""
        return self.max_tokens

    @property
    def logprob_n(self) -> int | None:
        """How many alternatives each token reports, None for no logprobs (each shape's
        own fields: logprobs and top_logprobs, n_probs)."""
        return None

    response_format: ResponseFormat | None = None
    json_schema: dict | None = None  # llama-server's spelling of a schema constraint
    grammar: str | None = None  # llama-server's raw GBNF constraint
    return_progress: bool = False  # llama-server's: streamed prompt_progress before the answer
    timings_per_token: bool = False  # llama-server's: each streamed piece says its timings

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    typical_p: float = Field(1.0, gt=0.0, le=1.0)
    mirostat: Literal[0, 1, 2] = 0  # llama-server's: Mirostat v1 or v2 instead of top-k/p
    mirostat_tau: float = Field(5.0, gt=0.0, le=100.0)
    mirostat_eta: float = Field(0.1, gt=0.0, le=1.0)
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repeat_penalty: float = Field(1.0, gt=0.0, le=10.0)
    # llama-server's and Ollama's: how many last tokens the penalties look at (-1: the context)
    repeat_last_n: int = Field(64, ge=-1, le=1_000_000)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=128, description="choices; at most the server's slots")
    user: str | None = Field(None, max_length=256)
    ignore_eos: bool = False  # llama-server's extension: keep generating past end-of-text
    logit_bias: dict[str, float] | None = Field(None, max_length=1024)  # token id -> -100..100

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, value):
        for token, bias in (value or {}).items():
            if not token.lstrip("-").isdigit():
                raise ValueError(f"keys are token ids (as /tokenize gives), not {token[:40]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"a bias is between -100 and 100, not {bias}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(len(s) > 256 for s in stops):
            raise ValueError("a stop string may be at most 256 characters")
        return [valid_text(s, "stop") for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs
# More messages than this are refused before each is validated (100,000 tiny ones took a second
# of the event loop): far more turns than any slot's context holds.
MAX_MESSAGES = 4096


def refuse_too_many_messages(data):
    """Before any message is validated: more than MAX_MESSAGES is refused at once."""
    if isinstance(data, dict) and isinstance(data.get("messages"), list) \
            and len(data["messages"]) > MAX_MESSAGES:
        raise OpenAIError(400, f"{len(data['messages'])} messages: at most {MAX_MESSAGES} are "
                          f"accepted (far more turns than a slot's context holds)",
                          code="context_length_exceeded", param="messages")
    return data


# What the server hands every chat template itself.
TEMPLATE_OWN = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                "raise_exception"}


class PromptEnding(BaseModel):
    """How a chat prompt ends, vLLM's and llama-server's fields: the template's assistant header
    (a new answer, the default), nothing, or the final assistant message left open and
    continued (Open WebUI's Continue button). Chat completions and /apply-template."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    _too_many = model_validator(mode="before")(refuse_too_many_messages)

    @model_validator(mode="after")
    def _continue_needs_an_answer_last(self):
        if self.continue_final_message:
            if "add_generation_prompt" in self.model_fields_set and self.add_generation_prompt:
                raise OpenAIError(400, "continue_final_message continues the last message: "
                                  "send add_generation_prompt false (or leave it out)",
                                  param="continue_final_message")
            if self.messages[-1].role != "assistant":
                raise OpenAIError(400, "continue_final_message needs an assistant message last",
                                  param="continue_final_message")
        return self

    @property
    def ending(self) -> str:
        """How the rendered prompt ends (prompt._chat_tokens). A final assistant message is
        continued when asked (continue_final_message), and also when neither flag is sent, as
        llama-server and Ollama do (a prefill): Open WebUI's Continue button sends the answer
        so far last, without flags, unless its connection is marked llama.cpp."""
        if self.continue_final_message or self.continues_by_default:
            return "continue"
        return "assistant" if self.add_generation_prompt else "none"

    @property
    def continues_by_default(self) -> bool:
        last = self.messages[-1]
        return (not {"add_generation_prompt", "continue_final_message"} & self.model_fields_set
                and last.role == "assistant" and not last.tool_calls and bool(last.content))


class ChatCompletionRequest(SamplingBody, PromptEnding):
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Variables for the chat template (vLLM's and llama-server's chat_template_kwargs, e.g.
    # Qwen 3's enable_thinking); reasoning_effort goes there for a template that reads it.
    chat_template_kwargs: dict[str, str | int | float | bool | None] | None = Field(None, max_length=16)
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _plain_variables(cls, value):
        for name in value or {}:
            if not name.isidentifier() or name in TEMPLATE_OWN:
                raise ValueError(f"{name[:40]!r} cannot be set: a template variable's name, not "
                                 f"one of {', '.join(sorted(TEMPLATE_OWN))}")
        return value

    @property
    def template_kwargs(self) -> dict:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs

    @property
    def logprob_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingBody):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @property
    def logprob_n(self) -> int | None:
        return self.logprobs
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS_LIMIT)  # OpenAI's default for completions
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("send one prompt per request (a list of several is not supported)")
            return valid_text(value[0], "prompt")
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        return valid_text(value, "prompt") if isinstance(value, str) else value


def translated_chat(fields: dict, kind: type[BaseModel] | None = None) -> ChatCompletionRequest:
    """The chat (or `kind`: completion) request an adapter (Messages, Responses, Ollama)
    translated its body into, validated as one: a field that does not validate is a 400
    naming it."""
    try:
        return (kind or ChatCompletionRequest)(**fields)
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(p) for p in problem.get("loc", ()))
        raise OpenAIError(400, f"{where}: {problem.get('msg')}", param=where or None) from None
