"""Scheduling policies behind one contract: continuous batching (the product) and two that
exist only to be measured against it (`--scheduler static|serial`, see localserve bench)."""

from __future__ import annotations

from localserve.engine.interfaces import Vocab
from localserve.engine.plan import StepPlan
from localserve.engine.prompt_cache import PromptCache
from localserve.engine.reuse import Placement
from localserve.engine.scheduler import Scheduler
from localserve.engine.slots import SlotPool


class StaticScheduler(Scheduler):
    """For comparison only (`--scheduler static|serial`): collect a batch of up to
    `max_num_seqs` waiting requests, run it until its LAST sequence finishes, then the next.
    Slots freed early stay idle meanwhile: the waste continuous batching removes.
    With max_num_seqs=1 this is `serial`, one request at a time like a loop around a model."""

    admits_midway = False

    def _admit_batch(self, plan: StepPlan) -> None:
        if any(s.busy for s in self.pool.slots):
            return
        for _ in range(self.max_num_seqs):
            if not self.waiting:
                return
            head = self.waiting.peek()
            choice = self.pool.best_idle_slot(head.all_tokens, head.cache_scope)
            if choice is None:
                return
            self._assign(plan, self.waiting.pop(), Placement(*choice))


POLICIES = ("continuous", "static", "serial")


def make_scheduler(policy: str, pool: SlotPool, vocab: Vocab, max_num_batched_tokens: int,
                   max_num_seqs: int | None = None, slot_share: int | None = None,
                   prefill_budget: int | None = None,
                   prompt_cache: PromptCache | None = None, speculative: bool = False,
                   max_long_prompts: int | None = None) -> Scheduler:
    if policy == "continuous":
        return Scheduler(pool, vocab, max_num_batched_tokens, max_num_seqs, slot_share,
                         prefill_budget, prompt_cache, speculative, max_long_prompts)
    if policy == "static":
        return StaticScheduler(pool, vocab, max_num_batched_tokens, max_num_seqs)
    if policy == "serial":
        return StaticScheduler(pool, vocab, max_num_batched_tokens, 1)
    raise ValueError(f"--scheduler {policy}: choose one of {', '.join(POLICIES)}")
