"""The scheduler's two bookkeepers of work not done twice (nano-vllm's BlockManager role: the
scheduler asks, they answer and keep their own books):

- PrefixBook: where an admitted request's prompt already is (an idle slot's kept prefix, a
  sibling's slot for n > 1, or the prompt cache beyond the slots, prompt_cache.py), and what a
  slot about to be overwritten must save first. The only user of the prompt cache on the
  engine thread: lookups, restores, saves, a removed key's entries.
- DraftBook: speculative drafts from a request's own n-grams (drafts.py): which decode rows
  get drafts this step, how many of them held, and what the slot's cache keeps after them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice

from localserve.engine.drafts import MAX_DRAFT, Acceptance, NgramDrafter, StepCost
from localserve.engine.plan import PHYSICAL_BATCH, SeqChunk, SlotSave, StepPlan
from localserve.engine.prompt_cache import BLOCK, CachedPrompt, PromptCache, within
from localserve.engine.request import Request
from localserve.engine.scheduler_stats import SchedulerStats
from localserve.engine.slots import (MIN_PREFIX_REUSE, Slot, SlotPool, SlotState, Wanted,
                                     common_prefix_len)


# Where sequences cannot be cut back, each new prompt's checkpoint is this many tokens before
# its end (llama-server's offset: its greedy text then comes from the same batches).
CHECKPOINT_BEFORE_END = 4
# The waiting requests whose slots an admission with a choice leaves them: a burst of
# colleagues arriving at once (bench/greedy.py's 7 and a probe), bounded so that a placement at
# -np 64 compares 8 requests with the idle slots, not 64 (6.5 ms a placement: docs/performance.md).
WANTED_LOOKAHEAD = 8
# llama-server's other stop before a prompt's end: its default ubatch (512) before the last 4
UBATCH_BEFORE_END = CHECKPOINT_BEFORE_END + 512


@dataclass(frozen=True)
class Placement:
    """Where an admission goes: its slot, the prefix it keeps, copied from `source` (a sibling
    choice's slot) or restored from `restore` (the prompt cache) when not already there."""

    slot: Slot
    keep: int
    source: Slot | None = None
    restore: CachedPrompt | None = None


class PrefixBook:
    def __init__(self, pool: SlotPool, prompt_cache: PromptCache | None,
                 waiting: Iterable[Request] = ()):
        self.pool = pool
        self.prompt_cache = prompt_cache  # sequences beyond the slots
        self.waiting = waiting  # requests whose cached slots an admission leaves them
        self.to_encode: list = []  # images admission waits for (place), handed to the plan

    def place(self, req: Request) -> Placement | None:
        """The idle slot sharing the longest prefix with the request (None: no slot idle);
        a sibling copies its prompt from the slot holding it; a longer prefix in the prompt
        cache is restored instead. None too while an image it must compute past that prefix
        is not encoded yet: the image goes to `to_encode` (the runner's encoder thread, asked
        by the loop through StepPlan.encodes), and the request waits, so the engine thread
        never runs the vision encoder and an image whose rows are cached is never encoded."""
        where = self._place(req)
        unready = req.unready_images(where.keep) if where is not None else []
        self.to_encode += unready
        return None if unready else where

    def _place(self, req: Request) -> Placement | None:
        choice = self.pool.best_idle_slot(req.all_tokens, req.cache_scope,
                                          self._wanted_by_others(req))
        if choice is None:
            return None
        slot, keep = choice
        if not self.pool.cuts_back:  # a copy holds its whole source: it could not be cut back
            return self._cached_prefix(req, slot, keep)  # to the prefix; checkpoints instead
        source = self._copy_source(req, keep)
        if source is not None:
            return Placement(slot, req.num_prompt_tokens - 1, source)
        return self._in_flight(req, self._cached_prefix(req, slot, keep))

    def _wanted_by_others(self, req: Request) -> Wanted:
        """The idle slots that the next few other waiting requests (one per slot, at most
        WANTED_LOOKAHEAD: each is compared with every idle slot) would reuse, found only when
        a placement has a choice to make."""
        def wanted() -> set[int]:
            few = min(len(self.pool.slots), WANTED_LOOKAHEAD)
            others = islice((r for r in self.waiting if r is not req), few)
            found = (self.pool.reusable_idle_slot(r.all_tokens, r.cache_scope) for r in others)
            return {slot_id for slot_id in found if slot_id is not None}
        return wanted

    def _copy_source(self, req: Request, keep: int) -> Slot | None:
        """A sibling choice (n > 1) copies its prompt from the slot holding it (the first
        choice's, busy or not) rather than computing it again; only the last prompt token is
        computed, for this choice's own first logits."""
        if req.prefix_of is None or req.output_tokens or keep >= req.num_prompt_tokens - 1:
            return None
        return self.pool.holding(req.prompt_tokens[:-1], req.cache_scope)

    def _in_flight(self, req: Request, where: Placement) -> Placement | None:
        """A running request of the same scope whose prompt shares more with this one than
        the idle slots and the prompt cache do (by MIN_PREFIX_REUSE; a system prompt that
        colleagues sent at once): its computed part is copied from its slot (llama.cpp shares
        the cells: computed once, held once). While its slot is still computing that part,
        this request waits (None), as a sibling does, unless the slot is a background task's
        (which sits out the steps in which a chat waits: scheduler invariant 9)."""
        tokens, floor = req.all_tokens, where.keep + MIN_PREFIX_REUSE
        best, best_done, computing = None, floor - 1, 0
        for slot in self.pool.slots:
            if slot.request is None or slot.cache_scope != req.cache_scope:
                continue
            shared = min(common_prefix_len(slot.request.all_tokens, tokens), len(tokens) - 1)
            if shared <= best_done:
                continue
            done = min(slot.prefix_shared(tokens), shared)
            if done > best_done:
                best, best_done = slot, done
            if done < shared and slot.state is SlotState.PREFILL and not slot.request.background:
                computing = max(computing, shared)
        if computing > best_done:
            return None  # copied once its slot has computed it
        if best is None:
            return where
        return Placement(self.pool.lru_idle(), best_done, source=best)

    def _cached_prefix(self, req: Request, slot: Slot, keep: int) -> Placement:
        """A longer prefix in the prompt cache than in any idle slot (by MIN_PREFIX_REUSE
        tokens at least) is restored into the least recently used idle slot instead."""
        cache, tokens = self.prompt_cache, req.all_tokens
        found = cache.lookup(tokens[:-1], req.cache_scope) if cache is not None else None
        if cache is not None and cache.whole_only and not req.images:  # (checkpoint)
            req.branch_point = branch_point(req, cache.shared(tokens[:-1], req.cache_scope))
        if (found is None or found[1] < keep + MIN_PREFIX_REUSE
                or not cache.load(found[0])):  # a file on disk that turned out unsound
            return Placement(slot, keep)
        entry, shared = found
        return Placement(self.pool.lru_idle(), shared, restore=entry)

    def taken(self, where: Placement) -> None:
        """Count a placement once it is admitted (a request placed again at every step
        while it waits for room counts once): a restore is a hit, else a miss."""
        cache = self.prompt_cache
        if cache is None or where.source is not None:
            return
        if where.restore is None:
            cache.stats.misses += 1
        else:
            cache.stats.hits += 1
            cache.stats.tokens_restored += where.keep

    def save(self, plan: StepPlan, slot: Slot) -> None:
        """Keep a slot's sequence in the prompt cache before the plan overwrites it (unless it
        is too short, or kept already)."""
        cache = self.prompt_cache
        if cache is None or slot.n_cached < BLOCK or cache.holds(slot.cached, slot.cache_scope):
            return
        plan.saves.append(SlotSave(slot.slot_id, slot.cache_scope, list(slot.cached)))

    def checkpoint(self, plan: StepPlan, slot: Slot, tokens: list[int]) -> list[int]:
        """Where sequences cannot be cut back (SlotPool.cuts_back), a new prompt's state is
        saved to the prompt cache as a checkpoint (llama-server's context checkpoints): where it
        parts from a cached prompt (Request.branch_point: the end of a system prompt that
        colleagues share, restored for the next one), and CHECKPOINT_BEFORE_END tokens before
        its end (llama-server's offset: a Regenerate, an edited turn or a conversation's
        earlier turn restores it). Its chunk stops at each, and goes on in the next step,
        after the save; and where llama-server's batch stops (prompt_stops), so that both
        compute the same rows in the same calls and answer alike."""
        req = slot.request
        if self.pool.cuts_back or self.prompt_cache is None or req.output_tokens:
            return tokens
        end = req.num_prompt_tokens - CHECKPOINT_BEFORE_END
        saves = [p for p in (req.branch_point, end) if BLOCK <= p <= end and after_text(req, p)]
        if slot.n_cached in saves and not any(a.slot_id == slot.slot_id for a in plan.admitted):
            self.save(plan, slot)  # read before this step's rows (an admission's: after)
        at = min((p for p in (*saves, *prompt_stops(req)) if p > slot.n_cached), default=0)
        before = at - slot.n_cached
        return tokens[:before] if 0 < before < len(tokens) else tokens

    def keep(self, saved) -> None:
        """The step's saves, serialized by the runner, into the prompt cache."""
        for save, state, size in saved:
            if size:
                self.prompt_cache.put(save.scope, save.tokens, state, size)

    def keep_slots(self, read_sequence) -> None:
        """Before the cache is freed (the loop stopped): each slot's sequence, read by
        `read_sequence(slot_id)` (the runner's), into the prompt cache unless it holds it."""
        cache = self.prompt_cache
        self.keep([(SlotSave(s.slot_id, s.cache_scope, list(s.cached)), *read_sequence(s.slot_id))
                   for s in self.pool.slots if s.cached and not cache.holds(s.cached, s.cache_scope)])

    def forget(self, entry: CachedPrompt | None) -> None:
        """An entry whose state would not load (RestoreFailed): never offered again (None: the
        slot's own cache would not be cut back; the slot forgot it)."""
        if entry is not None:
            self.prompt_cache.remove(entry)

    def drop_scope(self, scope: str) -> int:
        """A removed key: forget its prompts in idle slots (never saved, never reused again)
        and in the prompt cache, files too; how many cache entries went."""
        for slot in self.pool.slots:
            if not slot.busy and within(slot.cache_scope, scope):
                slot.forget()
        return self.prompt_cache.drop_scope(scope) if self.prompt_cache is not None else 0


class DraftBook:
    def __init__(self, pool: SlotPool, stats: SchedulerStats, speculative: bool):
        self.pool, self.stats = pool, stats
        # a step's drafts at most: where sequences cannot be cut back, as many rows as the
        # cache can take out again (SlotPool.rollback: a hybrid's earlier states, a window's)
        self.most = MAX_DRAFT if pool.cuts_back else pool.rollback
        self.speculative = speculative and self.most > 0  # n-gram drafts (drafts.py)
        self.acceptance = Acceptance()
        self.cost = StepCost()
        self._trims: list[tuple[int, int]] = []  # (slot, tokens kept) for the next plan

    def add(self, plan: StepPlan, budget: int) -> None:
        """Give the budget (and pool cells) left after everything else to decode rows as
        n-gram drafts, in plan order, each as many as make the step's tokens per second highest (drafts.py: its
        match's measured acceptance against the measured cost of a step that size). None in a
        step that gives a chat its first token: the colleague waits on that step alone."""
        if not self.speculative or plan.gives_first_token:
            return
        if self.pool.window:  # its rows go back whole within one physical batch only
            budget = min(budget, PHYSICAL_BATCH - plan.num_tokens)
        decode_rows = rows = plan.num_decode_rows
        for chunk in plan.chunks:
            if budget <= 0:
                return
            slot, req = self.pool.slots[chunk.slot_id], chunk.request
            if (slot.state is not SlotState.DECODE or len(chunk.tokens) != 1
                    or req.params.logprobs is not None):
                continue
            room = min(budget, self.most, slot.n_ctx - slot.n_cached - 2,
                       req.params.max_tokens - req.num_output_tokens - 1)
            if req.drafter is None:
                req.drafter = NgramDrafter()
            proposal = req.drafter.propose(req.all_tokens, room)
            if not proposal.tokens:
                continue
            drafts = proposal.tokens[:self.cost.worth(
                self.acceptance.draw(proposal.match), rows, decode_rows, len(proposal.tokens))]
            rows += len(drafts)
            chunk.tokens += drafts
            chunk.drafts = len(drafts)
            budget -= len(drafts)

    def timed(self, plan: StepPlan, seconds: float) -> None:
        """A step's decode and sampling time, what the next steps' drafts are weighed against:
        only a step of decode and draft rows, the kind whose size a draft chooses. A prompt
        chunk's rows want no logits and cost less (8 / 32 / 64 rows after 700 tokens: 41.0 /
        136.2 / 217.5 ms against 45.3 / 151.8 / 247.3 with every row's logits), and come early
        in a short context: counted in, they priced a 64-row draft step at 190 ms where one
        costs ~250, and 48 rows above 64."""
        if plan.num_decode_rows == len(plan.chunks):
            self.cost.observe(plan.num_tokens, seconds)

    def take(self, chunk: SeqChunk, sampled: list[int]) -> list[int]:
        """The tokens sampled for a chunk: one, or for a drafted chunk the drafts that held
        and the token sampled after them. Counts acceptance and tells the drafter."""
        if not chunk.drafts:
            return sampled
        accepted = len(sampled) - 1
        self.stats.draft_tokens += chunk.drafts
        self.stats.draft_tokens_accepted += accepted
        self.acceptance.record(chunk.request.drafter.match, chunk.drafts, accepted)
        chunk.request.drafter.feedback(chunk.drafts, accepted)
        return sampled

    def kept_in_cache(self, chunk: SeqChunk, sampled: list[int]) -> list[int]:
        """A drafted chunk's cache keeps its first token and the drafts that held; the rows
        of those that failed are trimmed at the start of the next step (StepPlan.trims)."""
        kept = chunk.tokens[:len(chunk.tokens) - chunk.drafts + len(sampled) - 1]
        if len(kept) < len(chunk.tokens):
            self._trims.append((chunk.slot_id, chunk.start_pos + len(kept)))
        return kept

    def pending_trims(self) -> list[tuple[int, int]]:
        trims, self._trims = self._trims, []
        return trims


def prompt_stops(req: Request) -> list[int]:
    """Where llama-server's batch stops inside a prompt that cannot be cut back
    (server-context.cpp): where its last user message starts, where its first does when nothing
    of it was cached, and UBATCH_BEFORE_END and CHECKPOINT_BEFORE_END tokens before its end."""
    turns, n = req.user_turns, req.num_prompt_tokens
    stops = [n - UBATCH_BEFORE_END, n - CHECKPOINT_BEFORE_END]
    if turns:
        stops += [turns[-1]] + ([turns[0]] if req.cached_tokens == 0 else [])
    return [p for p in stops if after_text(req, p)]


def after_text(req: Request, at: int) -> bool:
    """A chunk may stop at `at`: after a text token, never inside an image's rows (llama-server
    counts its stops on text tokens only; an image a model reads two-way is decoded whole)."""
    return 0 < at <= req.num_prompt_tokens and req.prompt_tokens[at - 1] >= 0


def branch_point(req: Request, shared: int) -> int:
    """Where a prompt sharing `shared` tokens with a cached one is checkpointed: in a chat, where
    the user message it parts in starts (a shared system prompt ends where the first user
    message starts), so that its chunks stop only where llama-server's would (prompt_stops);
    where it parts within the first (Gemma's template writes the system prompt into it), where
    it parts, so that colleagues still share their system prompt."""
    at = max((turn for turn in req.user_turns if turn <= shared), default=0)
    return at if at >= BLOCK else shared
