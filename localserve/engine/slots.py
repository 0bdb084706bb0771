"""Slots: the engine's fixed set of llama.cpp sequences, and how the `-c` budget is split.

One slot = one llama.cpp sequence id = one request at a time, as in llama-server.
`-c 8192 --parallel 4` gives four slots of 2048 tokens each: every position of a slot's
cache counts against its own limit, never a neighbour's.

State machine of a slot:  IDLE --admit--> PREFILL --last prompt chunk--> DECODE --finish/abort--> IDLE
A slot keeps the tokens it holds in cache after its request ends, so the next request that
shares a prefix with them (a chat's next turn, a common system prompt) prefills only the rest.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from localserve.engine.detokenize import IncrementalDetokenizer
from localserve.engine.request import Request


class SlotState(enum.Enum):
    IDLE = "idle"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(eq=False)
class Slot:
    slot_id: int
    n_ctx: int
    state: SlotState = SlotState.IDLE
    request: Request | None = None
    cached: list[int] = field(default_factory=list)  # tokens in this slot's cache, positions 0..n-1
    detokenizer: IncrementalDetokenizer | None = None
    last_used: float = 0.0

    @property
    def n_cached(self) -> int:
        return len(self.cached)

    @property
    def busy(self) -> bool:
        return self.request is not None

    def pending_tokens(self) -> list[int]:
        """Tokens of the request not yet in cache: the prompt rest, or the last sampled token."""
        req = self.request
        n_prompt = req.num_prompt_tokens
        if self.n_cached < n_prompt:
            return req.prompt_tokens[self.n_cached:] + req.output_tokens
        return req.output_tokens[self.n_cached - n_prompt:]

    def assign(self, request: Request, keep: int) -> None:
        """Take a request, keeping the first `keep` cached tokens (a shared prefix)."""
        del self.cached[keep:]
        self.request = request
        self.state = SlotState.PREFILL
        self.detokenizer = IncrementalDetokenizer(request.params.stop)
        request.cached_tokens = keep

    def release(self) -> None:
        """Back to IDLE; the cache stays for prefix reuse."""
        self.request = None
        self.detokenizer = None
        self.state = SlotState.IDLE
        self.last_used = time.monotonic()


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SlotPool:
    """The `-c` split: `n_slots` slots of `ctx_size // n_slots` tokens each."""

    def __init__(self, ctx_size: int, n_slots: int):
        if n_slots < 1:
            raise ValueError("--parallel must be at least 1")
        if ctx_size // n_slots < 16:
            raise ValueError(f"-c {ctx_size} split over {n_slots} slots leaves "
                             f"{ctx_size // n_slots} tokens per slot; raise -c or lower --parallel")
        self.ctx_size = ctx_size
        self.n_ctx_per_slot = ctx_size // n_slots
        self.slots = [Slot(i, self.n_ctx_per_slot) for i in range(n_slots)]

    def describe(self) -> str:
        return (f"{len(self.slots)} slots × {self.n_ctx_per_slot} tokens = -c {self.ctx_size} "
                f"(each request's prompt + output must fit in {self.n_ctx_per_slot} tokens)")

    def best_idle_slot(self, prompt: list[int]) -> tuple[Slot, int] | None:
        """The idle slot sharing the longest cached prefix with `prompt`, else the least recently
        used one; with how many cached tokens it can keep (always leaving >= 1 prompt token to
        compute, because the first output token needs logits from a decoded prompt token)."""
        best, best_key = None, None
        for slot in self.slots:
            if slot.busy:
                continue
            lcp = min(common_prefix_len(slot.cached, prompt), len(prompt) - 1)
            key = (lcp, -slot.last_used)
            if best_key is None or key > best_key:
                best, best_key = slot, key
        return None if best is None else (best, best_key[0])
