"""What one engine step does: the scheduler's plan, handed to the runner as one batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from localserve.engine.prompt_cache import CachedPrompt
from localserve.engine.request import Request

if TYPE_CHECKING:
    from localserve.engine.slots import Slot


PHYSICAL_BATCH = 512  # the rows llama.cpp computes at once (n_ubatch: runner/model_file.py)


@dataclass
class SeqChunk:
    """Consecutive tokens of one slot's sequence, placed at positions start_pos, start_pos+1, ..."""

    slot_id: int
    request: Request
    tokens: list[int]
    start_pos: int
    sample: bool  # logits for the last token are wanted: a token is sampled for this row
    drafts: int = 0  # the last `drafts` tokens are speculative: every row from the first
    # token on is sampled, while each sampled token equals the next draft (drafts.py)


@dataclass(frozen=True)
class Admission:
    """A slot newly given a request this step. The runner clears the slot's cache beyond
    `kept_tokens` (the reused prefix) and builds the request's sampler. With `copy_from`, the
    kept prefix is first copied from that slot's sequence (a sibling choice of n > 1); with
    `restore`, it is first restored from the prompt cache: from `restore_state`, the entry's
    state taken when the step was planned, so that this step's own saves (whose RAM trim may
    send the entry back to disk) cannot pull it from under the restore."""

    slot_id: int
    request: Request
    kept_tokens: int
    copy_from: int | None = None
    restore: CachedPrompt | None = None
    restore_state: object | None = None


@dataclass(frozen=True)
class SlotSave:
    """Keep this slot's sequence (`tokens`, filled within `scope`) in the prompt cache before
    the step changes it: the runner does saves first."""

    slot_id: int
    scope: str | None
    tokens: list[int]


@dataclass(frozen=True)
class StopRule:
    """Which request, arriving while a step computes, stops it (runner/interrupt.py): made by
    the scheduler with the plan (invariants 9 and 12), published by the loop to the HTTP side
    while that step computes (engine/loop.py), NEVER between steps. Background tasks stop
    nothing."""

    below: int = 0  # a chat whose prompt is shorter than this stops the step (0: none does) ...
    not_to: frozenset = frozenset()  # ... unless its key is one of these
    tasks_only: bool = False  # every row a background task's: any chat stops it, even one
    # still being tokenized (EngineLoop.chat_on_its_way)

    def stops(self, request: Request) -> bool:
        if request.background:
            return False
        return self.tasks_only or (request.num_prompt_tokens < self.below
                                   and request.user not in self.not_to)


NEVER = StopRule()


@dataclass
class StepPlan:
    chunks: list[SeqChunk] = field(default_factory=list)
    admitted: list[Admission] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)  # slots whose whole cache must be cleared
    trims: list[tuple[int, int]] = field(default_factory=list)  # (slot, tokens kept): the
    # rows of drafts that failed last step leave the cache first (drafts.py)
    saves: list[SlotSave] = field(default_factory=list)
    stop_rule: StopRule = NEVER  # which arriving request stops this step (stop_rule_for)
    encodes: list = field(default_factory=list)  # images admission waits for: encoded off the
    # engine thread (Runner.encode_ahead), their requests admitted once they are ready

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)

    @property
    def num_decode_rows(self) -> int:
        return sum(1 for c in self.chunks if len(c.tokens) - c.drafts == 1 and c.sample
                   and c.start_pos >= c.request.num_prompt_tokens)

    @property
    def first_token_keys(self) -> set[str | None]:
        """The keys whose chats get their first token this step (frontends' tasks left out)."""
        return {c.request.user for c in self.chunks
                if c.sample and not c.request.output_tokens and not c.request.background}

    @property
    def gives_first_token(self) -> bool:
        """A chat's first token is sampled this step: a colleague waits on it, so no drafts
        lengthen it (reuse.DraftBook.add)."""
        return bool(self.first_token_keys)

    def stop_rule_for(self, below: int, waiting_keys: set) -> StopRule:
        """Which arriving chats may stop this step: any, where every row is a background
        task's (invariant 9); those shorter than `below` (invariant 12; 0: none), where no row
        is sampled, or, where the first tokens are all of one key with more of its requests
        waiting, another key's (ten sent at once: a colleague's chat does not wait for the
        first of them, whose step is then planned again beside it)."""
        firsts, tasks_only = self.first_token_keys, self.background_only
        if not any(c.sample for c in self.chunks):
            return StopRule(below, tasks_only=tasks_only)
        if len(firsts) == 1 and firsts <= waiting_keys:
            return StopRule(below, frozenset(firsts), tasks_only)
        return StopRule(tasks_only=tasks_only)

    @property
    def background_only(self) -> bool:
        """Every row serves a frontend's background task: a chat that arrives may interrupt it."""
        return bool(self.chunks) and all(c.request.background for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


@dataclass
class StepOutput:
    """What the runner made of one StepPlan: for each sampled chunk's slot, the tokens sampled
    (one; for a drafted chunk, the drafts that held and the token sampled after them), the
    log-probabilities of the rows that asked for them, where the time went, and the slots whose
    grammar cost more than its bound to constrain a token (their requests are ended)."""

    sampled: dict[int, list[int]]
    saved: list[tuple[SlotSave, object, int]] = field(default_factory=list)  # the plan's
    # saves, serialized (state, bytes), for the scheduler to keep in the prompt cache
    logprobs: dict[int, tuple] = field(default_factory=dict)
    costly_grammars: frozenset[int] = frozenset()
    grammar_s: dict[int, float] = field(default_factory=dict)  # per slot: its grammar's CPU s
    decode_s: float = 0.0  # inside llama_decode
    sample_s: float = 0.0  # inside the samplers


class Lanes(NamedTuple):
    """A step's running slots, by who may step (scheduler invariants 8 and 9)."""
    running: list[Slot]
    chat_starting: bool  # a chat waits or computes its prompt: tasks rest
    resting: list[Slot]  # tasks sitting this step out
    stepping: list[Slot]  # everyone who steps
    chats: list[Slot]
    tasks: list[Slot]
