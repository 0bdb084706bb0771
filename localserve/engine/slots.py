"""Slots: the engine's fixed set of llama.cpp sequences, and how the `-c` budget is split.

One slot = one llama.cpp sequence id = one request at a time, as in llama-server.
`-c 8192 --parallel 4` gives four slots of 2048 tokens each: every position of a slot's
cache counts against its own limit, never a neighbour's.

State machine of a slot:  IDLE --assign--> PREFILL --first token--> DECODE --release--> IDLE
Only assign() and release() change it, and each refuses an illegal move; PREFILL vs DECODE is
derived from how much of the request is in cache (as vLLM derives it from
num_computed_tokens), so it can never disagree with the tokens.
A slot keeps the tokens it holds in cache after its request ends, so the next request that
shares a prefix with them (a chat's next turn, a common system prompt) prefills only the rest;
with a prompt cache, only until a step computes for someone else (then they are parked there:
PoolKeeper.park_idle).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from localserve.engine.detokenize import IncrementalDetokenizer
from localserve.engine.request import Request


# A shorter shared prefix does not justify overwriting the least recently used slot's cache.
MIN_PREFIX_REUSE = 16
# Nor one under this share of what the slot holds: a title sharing a chat's template opening
# would put the chat's whole conversation aside (llama-server: --slot-prompt-similarity 0.1).
MIN_PREFIX_SHARE = 0.1
_PREFIX_BLOCK = 64
Wanted = Callable[[], set[int]]  # the idle slots other waiting requests would reuse, asked lazily


class SlotState(enum.Enum):
    IDLE = "idle"
    PREFILL = "prefill"
    DECODE = "decode"


class CachedTokens(Sequence):
    """A read-only view of the tokens in a slot's cache (no copy): only the slot's own methods
    change them, as llama.cpp's server_slot owns its cache operations, so what a slot says it
    holds cannot drift from its llama.cpp sequence. Slices are copies (lists)."""

    __slots__ = ("_tokens",)

    def __init__(self, tokens: list[int]):
        self._tokens = tokens

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, index):
        return self._tokens[index]

    def __iter__(self):
        return iter(self._tokens)

    def __repr__(self) -> str:
        return f"CachedTokens({self._tokens!r})"


class PoolTally:
    """What a pool's slots hold together, kept by the slots as they change: the cells their
    caches hold and the slots that serve a request (ids). A step asks both many times (the free
    cells for every chunk it plans, the running slots in each rule): summed over every slot
    each time, they were a third of a 32-row step's planning at -np 64."""

    __slots__ = ("cells", "busy")

    def __init__(self):
        self.cells = 0
        self.busy: set[int] = set()


@dataclass(eq=False)
class Slot:
    slot_id: int
    n_ctx: int
    request: Request | None = None
    _tokens: list[int] = field(default_factory=list, repr=False)  # in cache, positions 0..n-1
    tally: PoolTally = field(default_factory=PoolTally, repr=False)  # the pool's, shared
    cache_scope: str | None = None  # whose tokens `cached` holds: only they may reuse them
    last_used: float = 0.0
    admitted_seq: int = 0  # admission order: the newest running request is preempted first

    @property
    def cached(self) -> CachedTokens:
        """The tokens in this slot's cache, read-only (CachedTokens)."""
        return CachedTokens(self._tokens)

    @property
    def n_cached(self) -> int:
        return len(self._tokens)

    def prefix_shared(self, tokens: list[int]) -> int:
        """How many of `tokens` this slot's cache holds from the start (compared on the list
        itself, not the view: up to a whole context per call)."""
        return common_prefix_len(self._tokens, tokens)

    @property
    def busy(self) -> bool:
        return self.request is not None

    @property
    def state(self) -> SlotState:
        """DECODE once a token was sampled and only that token is missing from cache;
        PREFILL while more is (a new prompt, or a preempted request's prompt and output)."""
        req = self.request
        if req is None:
            return SlotState.IDLE
        if req.output_tokens and self.n_cached >= req.num_prompt_tokens + req.num_output_tokens - 1:
            return SlotState.DECODE
        return SlotState.PREFILL

    def pending_tokens(self) -> list[int]:
        """Tokens of the request not yet in cache: the prompt rest, or the last sampled token."""
        req = self.request
        n_prompt = req.num_prompt_tokens
        if self.n_cached < n_prompt:
            return req.prompt_tokens[self.n_cached:] + req.output_tokens
        return req.output_tokens[self.n_cached - n_prompt:]

    def assign(self, request: Request, keep: int, admitted_seq: int,
               copied: list[int] | None = None, restored: bool = False) -> None:
        """IDLE -> PREFILL: take a request, keeping the first `keep` cached tokens (a shared
        prefix), or holding `copied` instead (another slot's prefix copied by the runner, or
        with `restored` a sequence from the prompt cache)."""
        if self.busy:
            raise RuntimeError(f"slot {self.slot_id} is busy with {self.request.request_id}")
        held = len(self._tokens)
        if copied is not None:
            self._tokens = list(copied)
        del self._tokens[keep:]
        self.tally.cells += len(self._tokens) - held
        self.cache_scope = request.cache_scope
        self.request = request
        self.tally.busy.add(self.slot_id)
        self.admitted_seq = admitted_seq
        if request.detokenizer is None:
            request.detokenizer = IncrementalDetokenizer(request.params.stop)
            request.cached_tokens = keep
            request.prefix_source = ("ram" if restored else "slot") if keep else None

    # ---- the slot's cache: only these change it (llama.cpp's server_slot does the same)
    def computed(self, tokens: list[int]) -> None:
        """`tokens` were decoded into this slot's sequence, after what it already holds."""
        self._tokens.extend(tokens)
        self.tally.cells += len(tokens)

    def forget(self) -> None:
        """The sequence was cleared (dropped for room, preempted, or left unknown by a failed
        decode): nothing cached is reusable."""
        self.tally.cells -= len(self._tokens)
        self._tokens.clear()

    def release(self) -> None:
        """-> IDLE; the cache stays for prefix reuse."""
        if not self.busy:
            raise RuntimeError(f"slot {self.slot_id} is already idle")
        self.request = None
        self.tally.busy.discard(self.slot_id)
        self.last_used = time.monotonic()


def worth_reusing(slot: Slot, shared: int) -> bool:
    """A prefix of `shared` tokens justifies overwriting the rest of what `slot` holds."""
    return shared >= max(MIN_PREFIX_REUSE, MIN_PREFIX_SHARE * slot.n_cached)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Compared a block at a time (list slices compare in C), then within the first block
    that differs: a whole context's comparison in well under a millisecond."""
    n = min(len(a), len(b))
    i = 0
    while i + _PREFIX_BLOCK <= n and a[i:i + _PREFIX_BLOCK] == b[i:i + _PREFIX_BLOCK]:
        i += _PREFIX_BLOCK
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SlotPool:
    """One cache pool of `ctx_size` cells (llama.cpp's unified KV cache) that `n_slots` slots
    draw from. Each slot is guaranteed `ctx_size // n_slots` cells (the `guarantee`); one
    sequence may grow to `n_ctx_per_slot` (the model's context, at most the pool) by borrowing
    cells no other slot uses. A borrower gives them back, preempted to the prompt cache, when
    a request within its guarantee needs them (scheduler.py). Without `n_ctx_per_slot` a
    sequence is held to its guarantee, as in llama.cpp's split cache.
    `cuts_back` False: the model's sequences cannot be cut back to a prefix (a recurrent state,
    or window layers whose older cells are gone): a slot's cache is reused whole or not at
    all, and nothing is copied from another slot (reuse.py). `window`: a sliding-window
    model's window, within which a slot's sequence can still be cut back (none of its cells
    has left the window yet: llama-server's rule, the cache's oldest position at most the cut
    point less the window).
    `rollback`: where sequences cannot be cut back, how many of a sequence's last positions
    can still be taken out (the earlier states llama.cpp keeps beside a recurrent one, or a
    window model's step): the most a step may draft (reuse.DraftBook).
    `streams`: each slot has a cache stream of its guarantee instead (llama.cpp without
    kv_unified, llama-server's at an explicit -np): nothing is borrowed, and no slot's cells
    slow or crowd another's, so idle ones stay where they are (PoolKeeper.park_idle)."""

    def __init__(self, ctx_size: int, n_slots: int, n_ctx_per_slot: int | None = None,
                 cuts_back: bool = True, window: int = 0, streams: bool = False,
                 rollback: int = 0):
        if n_slots < 1:
            raise ValueError("--parallel must be at least 1")
        if n_ctx_per_slot is None and ctx_size // n_slots < 16:
            raise ValueError(f"-c {ctx_size} split over {n_slots} slots leaves "
                             f"{ctx_size // n_slots} tokens per slot; raise -c or lower --parallel")
        self.ctx_size, self.cuts_back, self.window = ctx_size, cuts_back, window
        self.rollback = rollback
        self.guarantee, self.streams = ctx_size // n_slots, streams
        self.n_ctx_per_slot = min(n_ctx_per_slot or self.guarantee,
                                  self.guarantee if streams else ctx_size)
        self.tally = PoolTally()
        self.slots = [Slot(i, self.n_ctx_per_slot, tally=self.tally) for i in range(n_slots)]

    @property
    def running(self) -> list[Slot]:
        """The slots serving a request, in slot order."""
        return [self.slots[i] for i in sorted(self.tally.busy)]

    @property
    def used(self) -> int:
        return self.tally.cells

    @property
    def free(self) -> int:
        return self.ctx_size - self.used

    def borrowed(self, slot: Slot) -> int:
        """Cells a slot holds beyond its guarantee."""
        return max(0, slot.n_cached - self.guarantee)

    def describe(self) -> str:
        if self.streams:
            return (f"{len(self.slots)} slots, each with a cache stream of its own "
                    f"{self.guarantee} tokens (--no-kv-unified: nothing borrowed)")
        return (f"{len(self.slots)} slots sharing one cache pool of {self.ctx_size} tokens, "
                f"{self.guarantee} guaranteed to each; one request may use up to "
                f"{self.n_ctx_per_slot} by borrowing cells the others do not use")

    def lru_idle(self) -> Slot | None:
        return min((s for s in self.slots if not s.busy), key=lambda s: s.last_used, default=None)

    @staticmethod
    def _spare(slots: list[Slot], wanted: Wanted | None) -> Slot:
        """The least recently used of `slots` (one at least) that no other waiting request
        would reuse (`wanted()`, asked only where there is a choice), else of them all."""
        if len(slots) > 1 and wanted is not None:
            taken = wanted()
            slots = [s for s in slots if s.slot_id not in taken] or slots
        return min(slots, key=lambda s: s.last_used)

    def lru_idle_with_cache(self, exclude: Slot | None = None) -> Slot | None:
        idle = [s for s in self.slots if not s.busy and s.cached and s is not exclude]
        return min(idle, key=lambda s: s.last_used, default=None)

    def holding(self, tokens: list[int], scope: str | None) -> Slot | None:
        """A slot, busy or idle, whose cache starts with all of `tokens`, filled within `scope`."""
        n = len(tokens)
        return next((s for s in self.slots if s.cache_scope == scope and s.n_cached >= n
                     and s.cached[:n] == tokens), None)

    def best_idle_slot(self, tokens: list[int], scope: str | None = None,
                       wanted: Wanted | None = None) -> tuple[Slot, int] | None:
        """The idle slot sharing the longest cached prefix with `tokens` (at least
        MIN_PREFIX_REUSE tokens and MIN_PREFIX_SHARE of its cache), else any idle one; with
        how many cached tokens it keeps (always leaving >= 1 token to compute: the next token
        needs fresh logits). Among equal choices, one whose cache no other waiting request
        would reuse (`wanted`), then the least recently used: a colleague's new chat, which
        shares only the template's opening with every slot, arriving beside a conversation's
        next turn leaves that conversation's slot to it.
        Only a slot whose cache was filled within the same `scope` shares anything: reuse
        across identities would tell one user what another sent (the cached-token count and
        the time to first token both reveal a match)."""
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None
        shared = {s.slot_id: self._reusable(s, tokens) if s.cache_scope == scope else 0
                  for s in idle}
        worth = [s for s in idle if worth_reusing(s, shared[s.slot_id])]
        if worth:
            most = max(shared[s.slot_id] for s in worth)
            worth = [s for s in worth if shared[s.slot_id] == most]
        best = self._spare(worth or idle, wanted)
        return best, shared[best.slot_id]

    def reusable_idle_slot(self, tokens: list[int], scope: str | None) -> int | None:
        """The id of the idle slot `best_idle_slot` would reuse for `tokens`, if any would."""
        choice = self.best_idle_slot(tokens, scope)
        if choice is None:
            return None
        slot, shared = choice
        return slot.slot_id if worth_reusing(slot, shared) else None

    def _reusable(self, slot: Slot, tokens: list[int]) -> int:
        """How much of `tokens` the slot's cache gives (at most all but the last token); where
        it cannot be cut back (a window model's sequence past its window), all it holds or
        nothing."""
        shared = min(slot.prefix_shared(tokens), len(tokens) - 1)
        cuts = self.cuts_back or slot.n_cached <= self.window
        return shared if cuts or shared == slot.n_cached else 0
