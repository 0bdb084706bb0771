"""The scheduler's ways of doing less work than computing every token once per request:
restoring prompts from the prompt cache instead of computing them again (prompt_cache.py),
and drafting tokens speculatively from a request's own n-grams (drafts.py). A mixin of
Scheduler: these methods read and write its pool, stats and plan like the rest of it."""

from __future__ import annotations

from localserve.engine.drafts import NgramDrafter
from localserve.engine.plan import SeqChunk, SlotSave, StepPlan
from localserve.engine.prompt_cache import BLOCK, CachedPrompt, within
from localserve.engine.request import Request
from localserve.engine.slots import MIN_PREFIX_REUSE, Slot, SlotState


class LessWork:
    def _cached_prefix(self, req: Request, slot: Slot,
                       keep: int) -> tuple[Slot, int, CachedPrompt | None]:
        """A longer prefix in the prompt cache than in any idle slot (by MIN_PREFIX_REUSE
        tokens at least) is restored into the least recently used idle slot instead."""
        cache, tokens = self.prompt_cache, req.all_tokens
        found = cache.lookup(tokens, req.cache_scope) if cache is not None else None
        if (found is None or min(found[1], len(tokens) - 1) < keep + MIN_PREFIX_REUSE
                or not cache.load(found[0])):  # a file on disk that turned out unsound
            if cache is not None:
                cache.stats.misses += 1
            return slot, keep, None
        entry, shared = found
        cache.stats.hits += 1
        cache.stats.tokens_restored += min(shared, len(tokens) - 1)
        return self.pool.lru_idle(), min(shared, len(tokens) - 1), entry

    def drop_scope(self, scope: str) -> int:
        """A removed key: forget its prompts in idle slots (never saved, never reused again)
        and in the prompt cache, files too; how many cache entries went."""
        for slot in self.pool.slots:
            if not slot.busy and within(slot.cache_scope, scope):
                slot.forget()
        return self.prompt_cache.drop_scope(scope) if self.prompt_cache is not None else 0

    def _save(self, plan: StepPlan, slot: Slot) -> None:
        """Keep a slot's sequence in the prompt cache before the plan overwrites it (unless it
        is too short, or kept already)."""
        cache = self.prompt_cache
        if cache is None or slot.n_cached < BLOCK or cache.holds(slot.cached, slot.cache_scope):
            return
        plan.saves.append(SlotSave(slot.slot_id, slot.cache_scope, list(slot.cached)))

    # ---- speculative drafts ---------------------------------------------------------
    def _add_drafts(self, plan: StepPlan, budget: int) -> None:
        """Give the budget left after everything else to decode rows as n-gram drafts, while
        at most `draft_max_streams` requests decode: with more, a CPU step is compute-bound and
        a kept draft costs as much as the step it saves (measured on chat at 8 streams: 77% of
        drafts kept, yet 7% slower; on copying answers at 1 and 4 streams: 2.06x and 1.37x)."""
        if not self.speculative or self.pool.unified or plan.num_decode_rows > self.draft_max_streams:
            return
        for chunk in plan.chunks:
            if budget <= 0:
                return
            slot, req = self.pool.slots[chunk.slot_id], chunk.request
            if (slot.state is not SlotState.DECODE or len(chunk.tokens) != 1
                    or req.params.logprobs is not None):
                continue
            room = min(budget, slot.n_ctx - slot.n_cached - 2,
                       req.params.max_tokens - req.num_output_tokens - 1)
            if req.drafter is None:
                req.drafter = NgramDrafter()
            drafts = req.drafter.propose(req.all_tokens, room)
            chunk.tokens += drafts
            chunk.drafts = len(drafts)
            budget -= len(drafts)

    def _take_sampled(self, chunk: SeqChunk, sampled) -> list[int]:
        """The tokens sampled for a chunk: one, or for a drafted chunk the drafts that held
        and the token sampled after them. Counts acceptance and tells the drafter."""
        if not chunk.drafts:
            return [sampled]
        accepted = len(sampled) - 1
        self.stats.draft_tokens += chunk.drafts
        self.stats.draft_tokens_accepted += accepted
        chunk.request.drafter.feedback(chunk.drafts, accepted)
        return sampled

    @staticmethod
    def _kept_in_cache(chunk: SeqChunk, sampled: list[int]) -> list[int]:
        """A drafted chunk's cache holds its first token and the drafts that held."""
        return chunk.tokens[:len(chunk.tokens) - chunk.drafts + len(sampled) - 1]
