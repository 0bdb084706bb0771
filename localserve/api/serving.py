"""The serving core every API shape shares, once admission (admission.py) has admitted the
request and the route has leased its model: the request's sampling settings (its own, else
the server's defaults), its chat prompt (tools or response_format as a grammar, the
template, tokenizing on worker threads), who it is billed to, the token reservation against
its key's quotas, and its queueing in the engine (submit). Route modules import this, never each other (vLLM's OpenAIServing role).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import NamedTuple

from starlette.concurrency import run_in_threadpool

from localserve.api import prompt, structured
from localserve.api.admission import Admitted
from localserve.api.image_fetch import fetch_images
from localserve.api.images import from_url
from localserve.api.reasoning import opens_reasoning, reasoning_kind
from localserve.api.schemas import ChatCompletionRequest, OpenAIError, SamplingBody
from localserve.common.config import Settings
from localserve.engine.loop import EngineUnavailable, QueueFull, UserQueueFull
from localserve.engine.request import Request as EngineRequest
from localserve.engine.request import SamplingParams
from localserve.engine.streams import ChoiceStreams
from localserve.models.image_inputs import PlacedImages
from localserve.models.model_host import ModelHost


# Request fields that fall back to the server's defaults (--temp, --top-k, --top-p, --seed).
SERVER_DEFAULTS = {"temperature": "temp", "top_k": "top_k", "top_p": "top_p", "seed": "seed"}


def server_defaults(server: Settings) -> dict:
    """What a request that leaves these fields out gets (shown in /props)."""
    return {field: getattr(server, flag) if getattr(server, flag) is not None
            else SamplingBody.model_fields[field].default for field, flag in SERVER_DEFAULTS.items()}


# Open WebUI's background tasks (a chat's title, its tags, follow-ups, search queries): each
# default prompt is one user message that opens with this and quotes the chat.
TASK_OPENING, TASK_QUOTE = "### Task:", "<chat_history>"


def background_task(body: SamplingBody) -> bool:
    """A frontend's background task, told by its prompt's shape (what Open WebUI forwards says
    nothing else of it). A client that dresses a request so only gets it served after every
    chat, with a small default answer: nothing to gain."""
    messages = getattr(body, "messages", None)
    if not messages:
        return False
    role, text = messages[-1].role, messages[-1].text
    return role == "user" and isinstance(text, str) and text.lstrip().startswith(TASK_OPENING) \
        and TASK_QUOTE in text


def sampling_params(body: SamplingBody, n_prompt: int, n_ctx: int, grammar: str | None = None,
                    server: Settings | None = None, background: bool = False) -> SamplingParams:
    """The engine's sampling settings: the body's, else the server's defaults, else OpenAI's.
    An answer the body does not bound gets the server's -n, else the room left in its
    context. A frontend's background task gets at most --task-max-tokens, whatever it asks:
    Open WebUI sends max_tokens 1000 with every title, which held a slot for minutes."""
    room = n_ctx - n_prompt
    fallback = server_defaults(server) if server is not None else {}
    chosen = {field: getattr(body, field) if field in body.model_fields_set or not fallback
              else fallback[field] for field in SERVER_DEFAULTS}
    if background and server is not None:
        limit = min(body.token_limit or server.task_max_tokens, server.task_max_tokens)
    else:
        limit = body.token_limit or (server.n_predict if server is not None else None) or room
    return SamplingParams(grammar=grammar, logprobs=body.logprob_n, max_tokens=min(limit, room),
        min_p=body.min_p, typical_p=body.typical_p, mirostat=body.mirostat,
        mirostat_tau=body.mirostat_tau, mirostat_eta=body.mirostat_eta,
        repeat_penalty=body.repeat_penalty,
        penalty_last_n=n_ctx if body.repeat_last_n < 0 else min(body.repeat_last_n, n_ctx),
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        stop=tuple(body.stop or ()), ignore_eos=body.ignore_eos,
        progress=body.return_progress and bool(getattr(body, "stream", False)),
        logit_bias=logit_bias(body), **chosen)


def logit_bias(body: SamplingBody) -> tuple[tuple[int, float], ...]:
    """OpenAI's {token id: bias} (ids checked against the vocabulary by submit)."""
    return tuple(sorted((int(token), bias) for token, bias in (body.logit_bias or {}).items()))


def tools_share(host: ModelHost, body: SamplingBody) -> str:
    """What the tools sent take of a prompt too long for its slot (frontends such as Open
    WebUI send a dozen built-in tools with every chat): said in the refusal."""
    tools = getattr(body, "tools", None)
    if not tools:
        return ""
    schemas = json.dumps([tool.model_dump(exclude_none=True) for tool in tools])
    n = len(host.tokenize(schemas, add_special=False, parse_special=False))
    return (f" The {len(tools)} tools' definitions alone take about {n} tokens: send fewer "
            f"tools (in Open WebUI, turn off the tools it attaches to this model's chats).")


# A grammar the engine ended as too costly, sent again by the same key: its 400 comes after
# this long, so a client looping on it sends one a second per connection (each would cost the
# server a parse of its body, and everyone else's streams that CPU).
REFUSED_AGAIN_DELAY_S = 1.0


def submit(admitted: Admitted, host: ModelHost, tokens: list[int], body: SamplingBody,
           grammar: str | None = None, endpoint: str = "",
           context_limit: int | None = None, images: PlacedImages | None = None,
           reasoning_open: bool = False, user_turns: tuple[int, ...] = ()) -> ChoiceStreams:
    """Queue the request's `n` choices: the first computes the prompt, the others copy it from
    its slot and sample with their own seeds (seed + i when a seed is given). What they may use
    is held against the key's token quotas first. `context_limit`: a context smaller than one
    request may use, that the client asked for (Ollama's num_ctx); prompt and answer fit in it.
    `images`: the prompt's images by hash (prompt.chat_prompt); `reasoning_open`: the prompt
    ends inside a reasoning block its template opened; `user_turns`: where a chat's user
    messages start (ChatPrompt.user_turns)."""
    user = admitted.user(body)
    refused = host.grammar_refusal(user, grammar)
    if refused:  # sent again after the engine ended it: answered late, at no cost (tarpit)
        raise OpenAIError(400, refused, code="grammar_cost", param="grammar",
                          delay_s=REFUSED_AGAIN_DELAY_S)
    n_ctx = min(host.n_ctx_per_slot, context_limit or host.n_ctx_per_slot)
    if not tokens:
        raise OpenAIError(400, "The prompt is empty: there is nothing to continue.", param="prompt")
    if len(tokens) >= n_ctx < host.n_ctx_per_slot:
        raise OpenAIError(400, f"This request's prompt is {len(tokens)} tokens, but it asked for "
                          f"a context of {n_ctx} (num_ctx), and the answer needs room too.",
                          code="context_length_exceeded", param="num_ctx")
    if len(tokens) >= n_ctx:
        raise prompt.too_long(host, f"prompt is {len(tokens)} tokens and its answer needs room "
                              f"too", "messages", tools_share(host, body))
    n_slots = host.settings.parallel
    if body.n > n_slots:
        raise OpenAIError(400, f"n={body.n} choices need {body.n} slots at once; this server has "
                          f"{n_slots} (--parallel)", param="n")
    background = background_task(body)
    params = sampling_params(body, len(tokens), n_ctx, grammar, host.settings, background)
    prompt.check_token_ids(host, [t for t, _ in params.logit_bias], "logit_bias")
    admitted.reserve_tokens(len(tokens) + params.max_tokens * body.n)
    choices: list[EngineRequest] = []
    for i in range(body.n):
        seeded = params if params.seed is None else replace(params, seed=params.seed + i)
        choices.append(EngineRequest(tokens, seeded, user=user, endpoint=endpoint,
                                     cache_scope=admitted.office.cache_scope(user),
                                     background=background, images=images or {},
                                     reasoning_open=reasoning_open, user_turns=user_turns,
                                     prefix_of=choices[0] if choices else None))
    try:
        return host.engine.submit_choices(choices)
    except UserQueueFull as exc:
        raise OpenAIError(429, f"{exc}; wait for some to finish.", code="queue_share_exceeded",
                          headers={"Retry-After": "2"})
    except QueueFull as exc:
        raise OpenAIError(503, f"The server is busy: {exc}. Retry in a few seconds.",
                          "server_error", code="queue_full", headers={"Retry-After": "2"})
    except EngineUnavailable as exc:
        raise OpenAIError(503, f"the server cannot take requests now: {exc}", "server_error")


def reasons(host: ModelHost) -> str:
    """How this model's answers carry reasoning to split off (reasoning.reasoning_kind): "think",
    "harmony", or "" for none."""
    return reasoning_kind(host.settings.reasoning_format, host.template_source)


class ChatPrompt(NamedTuple):
    tokens: list[int]
    grammar: str | None
    plan: object  # structured.ToolPlan or None
    images: PlacedImages  # the images placed among the tokens, by hash
    reasoning_open: bool  # the template opened a reasoning block the answer starts in
    user_turns: tuple[int, ...]  # where its user messages start (ModelHost.user_turns)


async def chat_tokens(host: ModelHost, body: ChatCompletionRequest,
                      key: str | None = None) -> ChatPrompt:
    """A chat request's prompt: tools or response_format become a grammar, the messages go
    through the template, their images through the projector (worker threads: prompt.py);
    images named by address are fetched first, counted against `key` (image_fetch.py)."""
    tools = await run_in_threadpool(structured.tool_setup, host, body)
    if tools is not None:
        messages, grammar, plan = tools
    else:
        messages, plan = [m.as_template_dict() for m in body.messages], None
        grammar = await run_in_threadpool(structured.request_grammar, host, body)
    tools_for_template = plan.template_tools if plan is not None else None
    source = host.template_source or ""
    if body.reasoning_effort is not None and "reasoning_effort" not in source:
        raise OpenAIError(400, f"'{host.model_id}' has no reasoning effort to set (its chat "
                          f"template does not read reasoning_effort); leave it out",
                          param="reasoning_effort")
    urls = [found for i, m in enumerate(body.messages) for found in m.image_urls(f"messages[{i}]")]
    if urls:
        prompt.check_reads_images(host, urls[0][1])
    images = await fetch_images([from_url(url, where, host.settings.image_urls)
                                 for url, where in urls], host.settings.image_url_hosts, key)
    tokens, placed, tail = await prompt.chat_prompt(host, messages, tools_for_template,
                                                    body.ending, body.template_kwargs, images, key)
    return ChatPrompt(tokens, grammar, plan, placed, opens_reasoning(reasons(host), tail),
                      await run_in_threadpool(host.user_turns, tokens))


async def start_chat(admitted: Admitted, body: ChatCompletionRequest, endpoint: str):
    """Admit and queue a chat request: (its model's host, its streams, its tool plan)."""
    async with admitted.lease(body.model) as host:
        return (host, *await queue_chat(admitted, host, body, endpoint))


async def queue_chat(admitted: Admitted, host: ModelHost, body: ChatCompletionRequest,
                     endpoint: str, context_limit: int | None = None):
    """Tokenize and queue a chat on a leased model: (its streams, its tool plan). The one path
    for every chat-shaped API: OpenAI's chat, Anthropic's Messages and Responses through
    start_chat, Ollama's chat and generate inside their own lease (which may only load)."""
    with host.chat_on_its_way(background_task(body)):
        chat = await chat_tokens(host, body, admitted.caller.key)
        return submit(admitted, host, chat.tokens, body, chat.grammar, endpoint, context_limit,
                      chat.images, chat.reasoning_open, chat.user_turns), chat.plan
