"""Fakes for the pure scheduler tests (no model): a vocabulary, scripted and positional
runners, and helpers to build a scheduler, requests, and run it until idle. Integration tests
use the real model through the real server instead."""

from localserve.engine.errors import CacheFull, Interrupted, RestoreFailed
from localserve.engine.plan import StepOutput
from localserve.engine.request import Request, SamplingParams
from localserve.engine.scheduler import Scheduler
from localserve.engine.slots import SlotPool

EOS = 0


class FakeVocab:
    """Token t renders as chr(ord('a') + t % 26); token 0 is end-of-generation."""

    def piece(self, token: int) -> bytes:
        return chr(ord("a") + token % 26).encode()

    def is_eog(self, token: int) -> bool:
        return token == EOS


class ScriptedRunner:
    """Answers each sampled row with the request's next scripted token, like a deterministic model."""

    def __init__(self, scripts: dict[str, list[int]]):
        self.scripts = scripts
        self.batches = []

    def decode(self, plan):
        self.batches.append([(c.slot_id, list(c.tokens), c.start_pos) for c in plan.chunks])
        sampled = {}
        for c in plan.chunks:
            if c.sample:
                script = self.scripts[c.request.request_id]
                sampled[c.slot_id] = [script[c.request.num_output_tokens]]
        return StepOutput(sampled)


def make(n_slots=2, ctx=64, budget=8, **kw):
    return Scheduler(SlotPool(ctx * n_slots, n_slots), FakeVocab(), budget, **kw)


def req(rid, n_prompt, max_tokens=100, stop=(), first=1):
    return Request(list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens, stop=stop),
                   request_id=rid)


def step(sched, runner, plan):
    """What the engine loop does with one plan: decode, keep its saves, update."""
    events = sched.update(plan, runner.decode(plan))
    assert_pool_tally(sched.pool)
    return events


def assert_pool_tally(pool):
    """What the pool counts (kept as the slots change) is what its slots hold and serve."""
    assert pool.used == sum(s.n_cached for s in pool.slots), "the pool's tally drifted"
    assert pool.running == [s for s in pool.slots if s.busy], "the pool's running slots drifted"


def run(sched, runner, steps=100):
    """Step until idle; return {request_id: (text, finish_reason)} and the step count."""
    out = {}
    for n in range(steps):
        if not sched.has_work():
            return out, n
        plan = sched.schedule()
        for r, ev in step(sched, runner, plan):
            text, _ = out.get(r.request_id, ("", None))
            out[r.request_id] = (text + ev.text, ev.finish_reason)
    raise AssertionError("did not finish")


class PositionalRunner:
    """A deterministic 'model' with llama.cpp's sequences: one list of cells per sequence id in
    one pool of `pool_size` cells. Each step, in the runner's order: trims (failed drafts),
    saves (the sequence read out for the prompt cache), drops, admissions (a copy from another
    sequence, or a restore of a saved state, then cut to the kept prefix), then the batch. A
    batch that needs more cells than the pool has fails as llama_decode does (CacheFull) and
    leaves every sequence as it was; so does an interrupted one (Interrupted, with its saves),
    after interrupt(): synchronous, it stops the next decode where llama_decode would. The
    next token depends on the whole sequence the slot's
    cache holds, so any lost, duplicated or misplaced token changes the output."""

    def __init__(self, pool_size: int):
        self.pool_size = pool_size
        self.cache: dict[int, list[int]] = {}
        self.max_used = 0
        self.restored = 0  # tokens put back from the prompt cache
        self.interrupting = False

    def interrupt(self):
        self.interrupting = True

    def forget_interrupt(self):
        self.interrupting = False

    def decode(self, plan):
        for slot_id, kept in plan.trims:
            del self.cache.setdefault(slot_id, [])[kept:]
        saved = [(save, list(self.cache.get(save.slot_id, [])), 4 * len(save.tokens))
                 for save in plan.saves]
        for save, state, _ in saved:
            assert state == save.tokens, "a save names tokens its sequence does not hold"
        for slot_id in plan.dropped:
            self.cache[slot_id] = []
        for a in plan.admitted:
            if a.copy_from is not None:  # llama_memory_seq_cp: the source's state before this step
                self.cache[a.slot_id] = list(self.cache[a.copy_from])
            elif a.restore is not None:
                assert a.restore_state is not None, "a restore without its state"
                self.cache[a.slot_id] = list(a.restore_state)  # all of it, then cut back
                if sum(len(s) for s in self.cache.values()) > self.pool_size:
                    del self.cache[a.slot_id][:]
                    raise RestoreFailed("no room for the restored state", a.restore)
                self.restored += a.kept_tokens
            del self.cache.setdefault(a.slot_id, [])[a.kept_tokens:]
        used = sum(len(s) for s in self.cache.values()) + plan.num_tokens
        if used > self.pool_size:
            raise CacheFull(f"no free cache cells for a batch of {plan.num_tokens} tokens")
        if self.interrupting:
            self.interrupting = False
            raise Interrupted("interrupted", saved)
        sampled = {}
        for c in plan.chunks:
            seq = self.cache.setdefault(c.slot_id, [])
            assert len(seq) == c.start_pos, "chunk placed at the wrong position"
            seq.extend(c.tokens)
            if c.sample:
                sampled[c.slot_id] = [1 + (sum(seq) * 31 + len(seq)) % 25]
        self.max_used = max(self.max_used, used)
        return StepOutput(sampled, saved=saved)


class RecurrentRunner(PositionalRunner):
    """PositionalRunner with llama.cpp's recurrent memory: a sequence is cleared or extended,
    never cut back to a prefix (llama_memory_seq_rm returns false), never copied in part,
    and a step is never stopped midway. A plan that asks for any of it fails the test."""

    def decode(self, plan):
        held = {s: len(cells) for s, cells in self.cache.items()}
        for slot_id, kept in plan.trims:
            assert kept >= held.get(slot_id, 0), "a recurrent state cut back (a draft's rows)"
        cleared = set(plan.dropped)
        for a in plan.admitted:
            assert a.copy_from is None, "a recurrent state copied to be cut back"
            whole = len(a.restore_state) if a.restore is not None else (
                0 if a.slot_id in cleared else held.get(a.slot_id, 0))
            assert a.kept_tokens in (0, whole), "a recurrent state cut back to a prefix"
        assert not self.interrupting, "a step of a recurrent model stopped midway"
        return super().decode(plan)


def run_all(sched, runner, requests, steps=5000):
    for r in requests:
        sched.add(r)
    out = {r.request_id: [] for r in requests}
    finish = {}
    for _ in range(steps):
        if not sched.has_work():
            break
        plan = sched.schedule()
        for r, ev in step(sched, runner, plan):
            out[r.request_id].extend(ev.token_ids)
            if ev.finished:
                finish[r.request_id] = ev.finish_reason
    return out, finish


class EventChoices:
    """A request's n choices as api/ reads them (engine/streams.ChoiceStreams): given events,
    as (choice index, TokenEvent), and the engine requests behind them (counts and clocks)."""

    def __init__(self, requests: list[Request], events: list):
        self.requests, self.events, self.cancelled = requests, list(events), False

    @property
    def n(self) -> int:
        return len(self.requests)

    @property
    def n_prompt_tokens(self) -> int:
        return self.requests[0].num_prompt_tokens

    @property
    def finished(self) -> bool:
        return True

    def cancel(self) -> None:
        self.cancelled = True

    async def _events(self):
        for pair in self.events:
            yield pair

    def __aiter__(self):
        return self._events()


class ScriptedChoices(EventChoices):
    """The events a pure scheduler emitted for scripted answers (a scripted runner), in the
    order it emitted them."""

    def __init__(self, scripts: dict[str, list[int]], n_prompt: int = 3, max_tokens: int = 100,
                 stop: tuple = ()):
        sched, runner = make(n_slots=len(scripts)), ScriptedRunner(scripts)
        requests = [req(rid, n_prompt, max_tokens, stop) for rid in scripts]
        index = {r.request_id: i for i, r in enumerate(requests)}
        for r in requests:
            sched.add(r)
        events = []
        while sched.has_work():
            for r, event in step(sched, runner, sched.schedule()):
                events.append((index[r.request_id], event))
        super().__init__(requests, events)
