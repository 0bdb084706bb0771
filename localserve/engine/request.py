"""What one request is while the engine holds it: its prompt, how to sample, what it produced.

A Request is created by the API (already tokenized and validated), handed to the engine
loop, and owned by the scheduler from then on. Its events leave through `emit`, a callable
the API side supplies, so the engine never touches asyncio objects directly.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from localserve.engine.detokenize import IncrementalDetokenizer
from localserve.engine.drafts import NgramDrafter
from localserve.engine.finish import FinishReason
from localserve.engine.image_rows import image_row

_ids = itertools.count(1)


class RequestStatus(enum.Enum):
    """WAITING --admitted--> RUNNING --ended--> FINISHED; preempted: RUNNING -> WAITING.
    An n > 1 sibling starts HELD until its first choice's prompt is in cache (it copies that
    prompt instead of computing it again), then waits like any other request."""

    HELD = "held"
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, in OpenAI / llama-server spelling. temperature 0 = greedy."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    mirostat: int = 0  # 1 or 2: Mirostat (v1, v2) aims at a target surprise instead of top-k/p
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    seed: int | None = None
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    progress: bool = False  # llama-server's return_progress: events as the prompt is computed
    grammar: str | None = None  # GBNF the output must follow (response_format, tools, grammar)
    logprobs: int | None = None  # None: off; N: each token's log-probability and the top N
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); -100 bans

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        return (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


@dataclass
class TokenEvent:
    """What the engine tells a request's client after a step: new text, and whether it ended."""

    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    stop_type: str = "none"  # a completed end's cause, llama-server's words: eos, word, limit
    # With SamplingParams.logprobs: (token, its log-probability, ((token, logprob), ...) top N)
    logprobs: tuple[int, float, tuple[tuple[int, float], ...]] | None = None
    # With SamplingParams.progress, before the first token: (prompt tokens, of those cached,
    # computed so far, milliseconds since admission); no text (engine/progress.py)
    progress: tuple[int, int, int, int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Request:
    prompt_tokens: list[int]
    params: SamplingParams
    emit: Callable[[TokenEvent], None] = lambda event: None
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    user: str | None = None  # identity: the API key's name (or the `user` field without keys)
    cache_scope: str | None = None  # whose cached prefixes this request may reuse (None: anyone's)
    arrival_time: float = field(default_factory=time.monotonic)
    endpoint: str = ""  # the API route it came through, for the ledger
    background: bool = False  # a frontend's background task (a title, tags): waits for chats

    status: RequestStatus = RequestStatus.WAITING
    output_tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    admitted_time: float | None = None  # first admission into a slot (queue time ends)
    first_token_time: float | None = None
    last_token_time: float | None = None  # kept by the metrics observer for inter-token gaps
    cached_tokens: int = 0  # prompt tokens found already in the slot's cache at admission
    prefix_source: str | None = None  # where they came from: "slot" or "ram" (the prompt cache)
    preemptions: int = 0  # times evicted from the cache and requeued
    long_prompt: bool = False  # admitted with more uncached prompt than one step computes
    times_passed: int = 0  # admissions past it while it could not fit (scheduler.py: aging)
    times_held: int = 0  # steps its prompt was held to a few tokens beside a starting chat
    times_stopped: int = 0  # steps of its that a chat stopped midway (long_prompts.py)
    # where its prompt parts from a cached one (a shared system prompt), checkpointed there
    # where sequences cannot be cut back (reuse.PrefixBook.checkpoint); 0: nowhere
    branch_point: int = 0
    # where its user messages start (a chat's; llama-server's message spans): where sequences
    # cannot be cut back, its prompt's chunks stop at the last, as llama-server's batches do
    user_turns: tuple[int, ...] = ()
    detokenizer: IncrementalDetokenizer | None = None  # lives with the request across preemptions
    holds_queue_place: bool = False  # counted against --max-queue until first admitted or ended
    # n > 1: the first choice; this one waits until that one's prompt is in cache, then
    # copies it (llama_memory_seq_cp) instead of computing it again.
    prefix_of: Request | None = None
    drafter: NgramDrafter | None = None  # speculative decoding: its n-gram index (drafts.py)
    # the prompt's images by hash: their rows are placeholder ids in prompt_tokens, decoded
    # from the image's embeddings (runner/images.py); the scheduler reads only their `ready`
    images: dict = field(default_factory=dict)
    # the prompt ends inside a reasoning block its template opened: the answer starts as
    # reasoning (api/answer.py); opaque to the engine
    reasoning_open: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_tokens)

    @property
    def all_tokens(self) -> list[int]:
        """Prompt plus generated tokens: what the slot's cache must hold to continue."""
        return self.prompt_tokens + self.output_tokens

    def unready_images(self, start: int) -> list:
        """The images with rows past `start` in the prompt whose embeddings the vision encoder
        has not made yet (runner/images.py): admission waits for them, off the engine thread
        (reuse.PrefixBook.place)."""
        if not self.images:
            return []
        hashes = dict.fromkeys(image_row(t)[0] for t in self.prompt_tokens[start:] if t < 0)
        return [self.images[h] for h in hashes if h in self.images and not self.images[h].ready]
