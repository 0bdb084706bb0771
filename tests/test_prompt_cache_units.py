"""Pure tests of the prompt cache beyond the slots and of its place in the scheduler: the
store's bound, scopes and lookups, and the plan's saves and restores (fake runner, no model)."""

from localserve.engine.prompt_cache import BLOCK, PromptCache
from localserve.engine.scheduler import Scheduler
from localserve.engine.slots import SlotPool

from fakes import EOS, FakeVocab, ScriptedRunner, req, run


def tokens(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def test_lookup_finds_the_longest_prefix_within_its_scope_only():
    cache = PromptCache(10_000)
    cache.put("alice", tokens(1, 100), "state-a", 100)
    cache.put("alice", tokens(1, 40) + tokens(500, 60), "state-b", 100)
    entry, shared = cache.lookup(tokens(1, 90) + [7, 7], "alice")
    assert entry.state == "state-a" and shared == 90
    entry, shared = cache.lookup(tokens(1, 40) + tokens(500, 20), "alice")
    assert entry.state == "state-b" and shared == 60
    assert cache.lookup(tokens(1, 100), "bob") is None  # another key finds nothing
    assert cache.lookup(tokens(1, BLOCK - 1), "alice") is None  # less than a block


def test_the_byte_bound_holds_and_the_least_recently_used_go_first():
    cache = PromptCache(300)
    for i in range(5):
        cache.put(None, tokens(1000 * (i + 1), 50), f"s{i}", 100)
        cache.lookup(tokens(1000, 50), None)  # the first one stays in use
        assert cache.nbytes <= 300
    kept = {e.state for e in cache.ram.values()}
    assert kept == {"s0", "s3", "s4"} and cache.stats.evictions == 2
    cache.put(None, tokens(1, 50), "too big", 301)
    assert "too big" not in {e.state for e in cache.ram.values()}


def test_a_longer_turn_of_the_same_conversation_replaces_the_earlier_one():
    cache = PromptCache(10_000)
    cache.put("a", tokens(1, 40), "turn 1", 40)
    cache.put("a", tokens(1, 80), "turn 2", 80)
    assert [e.state for e in cache.ram.values()] == ["turn 2"] and cache.nbytes == 80
    assert cache.holds(tokens(1, 40), "a") and not cache.holds(tokens(1, 81), "a")
    assert cache.drop_scope("a") == 1 and cache.nbytes == 0 and not cache._index


class SavingRunner(ScriptedRunner):
    """Plays the runner's part of the prompt cache: saves put the slot's tokens in the store."""

    def __init__(self, scripts, cache):
        super().__init__(scripts)
        self.cache, self.restored = cache, []

    def decode(self, plan):
        self.restored += [(a.request.request_id, a.kept_tokens) for a in plan.admitted if a.restore]
        out = super().decode(plan)
        out.saved = [(save, f"state of slot {save.slot_id}", len(save.tokens)) for save in plan.saves]
        return out


def make_cached(n_slots=1):
    cache = PromptCache(100_000)
    return Scheduler(SlotPool(256 * n_slots, n_slots), FakeVocab(), 64, prompt_cache=cache), cache


def test_a_prompt_overwritten_in_its_slot_is_saved_then_restored_not_recomputed():
    sched, cache = make_cached()
    runner = SavingRunner({"doc1": [9, EOS], "doc2": [9, EOS], "again": [9, EOS],
                           "follow": [9, EOS]}, cache)
    first = req("doc1", 60, first=1)
    sched.add(first)
    run(sched, runner)
    sched.add(req("doc2", 60, first=100))  # takes the only slot: doc1's sequence is saved first
    run(sched, runner)
    assert cache.holds(tokens(1, 60), None)
    computed = sched.stats.prompt_tokens_computed
    again = req("again", 70, first=1)  # doc1 plus a follow-up
    sched.add(again)
    run(sched, runner)
    assert runner.restored == [("again", 60)]  # all the document: only the follow-up computed
    assert sched.stats.prompt_tokens_computed - computed == 70 - 60
    assert (first.prefix_source, again.prefix_source) == (None, "ram")  # what the ledger says
    follow = req("follow", 75, first=1)  # the slot itself now holds it
    sched.add(follow)
    run(sched, runner)
    assert (follow.prefix_source, follow.cached_tokens) == ("slot", 70)


def test_an_idle_slots_prompt_is_parked_while_another_request_computes_then_restored():
    """Every row attends over the whole pool: an idle conversation is saved and cleared in the
    first step that computes for someone else, and comes back by a restore."""
    sched, cache = make_cached(n_slots=2)
    runner = SavingRunner({"doc": [9, EOS], "other": [5] * 10 + [EOS], "follow": [9, EOS]}, cache)
    sched.add(req("doc", 60, first=1))
    run(sched, runner)
    kept = next(s for s in sched.pool.slots if s.cached)
    assert kept.n_cached >= 60  # nothing else computes: it stays in its slot
    sched.add(req("other", 30, first=100))
    plan = sched.schedule()
    assert plan.dropped == [kept.slot_id] and [save.slot_id for save in plan.saves] == [kept.slot_id]
    sched.update(plan, runner.decode(plan))
    assert not kept.cached and cache.holds(tokens(1, 60), None)
    follow = req("follow", 70, first=1)
    sched.add(follow)
    run(sched, runner)
    assert runner.restored == [("follow", 60)] and follow.prefix_source == "ram"


def test_a_title_takes_neither_the_chats_slot_nor_parks_it():
    """Open WebUI titles a chat while its colleague types the next turn. The title's prompt
    shares only the template's opening with the chat's slot (20 of 200 tokens): it takes
    another slot, and its steps (background tasks only) park nothing, so the chat's next turn
    finds its conversation in its slot (a save and a restore cost 0.1 s of a 0.18 s first
    token before)."""
    sched, cache = make_cached(n_slots=2)
    runner = SavingRunner({"chat": [9, EOS], "title": [5] * 10 + [EOS], "next": [9, EOS]}, cache)
    sched.add(req("chat", 200, first=1))
    run(sched, runner)
    title = req("title", 60, first=1)
    title.prompt_tokens[20:] = tokens(1000, 40)
    title.background = True
    sched.add(title)
    run(sched, runner)
    assert cache.stats.saves == 0 and sched.pool.slots[0].n_cached >= 200
    follow = req("next", 220, first=1)
    sched.add(follow)
    run(sched, runner)
    assert (follow.prefix_source, follow.cached_tokens) == ("slot", 200)


def test_without_a_prompt_cache_an_idle_slot_keeps_its_prompt():
    sched = Scheduler(SlotPool(512, 2), FakeVocab(), 64)
    runner = ScriptedRunner({"doc": [9, EOS], "other": [5] * 10 + [EOS], "follow": [9, EOS]})
    sched.add(req("doc", 60, first=1))
    run(sched, runner)
    sched.add(req("other", 30, first=100))
    run(sched, runner)
    follow = req("follow", 70, first=1)
    sched.add(follow)
    run(sched, runner)
    assert (follow.prefix_source, follow.cached_tokens) == ("slot", 60)


def test_a_cached_prompt_is_never_restored_for_another_scope():
    sched, cache = make_cached()
    runner = SavingRunner({"a": [9, EOS], "b": [9, EOS], "c": [9, EOS]}, cache)
    first = req("a", 60)
    first.cache_scope = "alice"
    sched.add(first)
    run(sched, runner)
    sched.add(req("b", 60, first=100))
    run(sched, runner)
    other = req("c", 60)
    other.cache_scope = "bob"
    sched.add(other)
    run(sched, runner)
    assert runner.restored == [] and other.cached_tokens == 0


def test_a_preempted_sequence_is_swapped_to_the_cache_and_restored():
    """alice holds both slots while nobody waits; bob arrives, alice's newest is preempted: its
    prompt and output so far are saved, and restored when it gets a slot again."""
    sched, cache = make_cached(n_slots=2)
    sched.shares.share = 1
    runner = SavingRunner({"a1": [5] * 40 + [EOS], "a2": [6] * 40 + [EOS], "b": [9] * 3 + [EOS]},
                          cache)
    mine = [req(rid, 30, first=first) for rid, first in (("a1", 1), ("a2", 100))]
    for request in mine:
        request.user = request.cache_scope = "alice"
        sched.add(request)
    for _ in range(5):
        sched.update(plan := sched.schedule(), runner.decode(plan))
    theirs = req("b", 20, first=300)
    theirs.user = theirs.cache_scope = "bob"
    sched.add(theirs)
    run(sched, runner)
    assert sched.stats.share_preemptions == 1
    assert [rid for rid, _ in runner.restored] == ["a2"]
    assert runner.restored[0][1] >= 30  # its prompt and its output so far came back
    assert mine[1].output_tokens == [6] * 40 + [EOS]  # and went on as if never interrupted


def test_the_disk_tier_takes_what_ram_evicts_and_reads_it_back(tmp_path):
    from localserve.engine.prompt_disk import DiskTier

    cache = PromptCache(250, DiskTier(tmp_path / "disk", 10_000, "model-a"))
    states = {i: bytes([i]) * 100 for i in range(3)}
    for i, state in states.items():
        cache.put("alice", tokens(1000 * (i + 1), 40), state, len(state))
    assert cache.nbytes <= 250 and cache.stats.disk_writes == 1
    entry, shared = cache.lookup(tokens(1000, 40), "alice")
    assert entry.state is None and shared == 40  # found on disk
    assert cache.load(entry) and entry.state == states[0] and cache.nbytes <= 250
    again = PromptCache(250, DiskTier(tmp_path / "disk", 10_000, "model-a"))  # a restart
    assert again.lookup(tokens(1000, 40), "alice") is not None
    assert again.lookup(tokens(1000, 40), "bob") is None
    other_model = PromptCache(250, DiskTier(tmp_path / "disk", 10_000, "model-b"))
    assert len(other_model) == 0 and not list((tmp_path / "disk").glob("*.cache"))


def test_a_removed_keys_files_are_deleted(tmp_path):
    from localserve.engine.prompt_disk import DiskTier

    cache = PromptCache(10_000, DiskTier(tmp_path, 10_000, "m"))
    cache.put("alice", tokens(1, 40), b"a" * 50, 50)
    cache.put("bob", tokens(1, 40), b"b" * 50, 50)
    assert cache.spill() == 2 and len(list(tmp_path.glob("*.cache"))) == 2
    assert cache.drop_scope("alice") == 1
    assert [f.read_bytes()[-50:] for f in tmp_path.glob("*.cache")] == [b"b" * 50]


class StateCheckingRunner(SavingRunner):
    """Records the state each restore would hand to llama.cpp; its saves go to the cache
    after the step (the engine loop's order)."""

    def decode(self, plan):
        self.restored += [(a.request.request_id, a.restore_state) for a in plan.admitted
                          if a.restore]
        out = ScriptedRunner.decode(self, plan)
        out.saved = [(save, bytes([save.tokens[0] % 256]) * 100, 100) for save in plan.saves]
        return out


def test_a_restore_read_from_disk_keeps_its_state_when_the_same_steps_save_trims_ram(tmp_path):
    """The segfault of hardening round 4: a restore is planned (the entry read back from disk
    into RAM), then the same step saves the slot it lands in, and that save's RAM trim sends the
    just-loaded entry back to disk. The plan pinned the state: the restore still has it."""
    from localserve.engine.prompt_disk import DiskTier

    cache = PromptCache(150, DiskTier(tmp_path, 100_000, "m"))  # RAM holds one entry
    sched = Scheduler(SlotPool(256, 1), FakeVocab(), 64, prompt_cache=cache)
    runner = StateCheckingRunner({rid: [9, EOS] for rid in ("a", "b", "c", "again")}, cache)
    for rid, first in (("a", 1), ("b", 100), ("c", 200)):
        sched.add(req(rid, 60, first=first))
        run(sched, runner)
    entry, _ = cache.lookup(tokens(1, 60), None)
    assert entry.state is None  # a's prompt went to disk
    sched.add(req("again", 70, first=1))
    run(sched, runner)
    assert runner.restored == [("again", bytes([1]) * 100)]  # not None: no null buffer
    assert entry.state is None  # the save did evict it again: only the pin kept the bytes


def test_planted_folders_fifos_and_links_in_the_cache_folder_neither_stop_nor_hang_start_up(tmp_path):
    import os

    from localserve.engine.prompt_disk import DiskTier

    cache = PromptCache(10_000, DiskTier(tmp_path, 10_000, "m"))
    cache.put("alice", tokens(1, 40), b"a" * 50, 50)
    assert cache.spill() == 1
    (tmp_path / "folder.cache").mkdir()
    os.mkfifo(tmp_path / "pipe.cache")  # opened plainly, this blocks start-up forever
    (tmp_path / "link.cache").symlink_to("/etc/passwd")
    again = PromptCache(10_000, DiskTier(tmp_path, 10_000, "m"))
    assert len(again) == 1 and again.lookup(tokens(1, 40), "alice") is not None
    assert (tmp_path / "folder.cache").is_dir() and (tmp_path / "pipe.cache").exists()


def test_a_removed_key_is_forgotten_in_idle_slots_and_at_start_in_files(tmp_path):
    from localserve.engine.prompt_disk import DiskTier

    sched, cache = make_cached()
    runner = SavingRunner({"a": [9, EOS]}, cache)
    mine = req("a", 60)
    mine.cache_scope = "alice"
    sched.add(mine)
    run(sched, runner)
    assert sched.pool.slots[0].cached  # the idle slot still holds alice's prompt
    sched.drop_scope("alice")
    assert not sched.pool.slots[0].cached  # never saved nor reused again
    disk = PromptCache(10_000, DiskTier(tmp_path, 10_000, "m"))
    for scope in ("alice", "bob"):
        disk.put(scope, tokens(1, 40), scope.encode() * 10, 50)
    disk.spill()
    again = PromptCache(10_000, DiskTier(tmp_path, 10_000, "m"))  # a restart: alice was removed
    assert again.keep_scopes(lambda scope: scope == "bob") == 1
    assert again.lookup(tokens(1, 40), "alice") is None and len(list(tmp_path.iterdir())) == 1
    assert PromptCache(10_000, DiskTier(tmp_path, 10_000, "m")).keep_scopes(lambda _: True) == 0


def test_the_cache_counts_saves_hits_misses_and_restored_tokens_and_the_threshold_is_exact():
    from localserve.engine.request import Request, SamplingParams
    from localserve.engine.reuse import PrefixBook
    from localserve.engine.slots import MIN_PREFIX_REUSE

    def ask(prompt):
        return Request(prompt, SamplingParams(max_tokens=4))

    cache = PromptCache(10_000)
    book = PrefixBook(SlotPool(4096, 2), cache)
    cache.put(None, tokens(1, 64), "s", 64)
    cache.put(None, tokens(1000, 64), "t", 64)
    cache.put(None, tokens(3000, BLOCK - 1), "too short", 1)  # not kept: under a block
    cache.put(None, tokens(4000, BLOCK), "a block", 1)  # a block: kept
    assert cache.stats.saves == 3 and "too short" not in {e.state for e in cache.ram.values()}
    whole_bound = PromptCache(100)
    whole_bound.put(None, tokens(1, BLOCK), "fills it", 100)
    assert whole_bound.stats.saves == 1 and whole_bound.nbytes == 100
    def take(prompt):  # placed, and admitted there: counted once
        placed = book.place(ask(prompt))
        book.taken(placed)
        return placed

    placed = book.place(ask(tokens(1, 64) + [9]))
    assert placed.restore.state == "s" and placed.keep == 64
    assert (cache.stats.hits, cache.stats.misses) == (0, 0)  # placed, not yet admitted
    book.taken(placed)
    assert (cache.stats.hits, cache.stats.misses, cache.stats.tokens_restored) == (1, 0, 64)
    assert take(tokens(5000, 64)).restore is None and cache.stats.misses == 1
    whole = take(tokens(1000, 64))  # the whole prompt: all but its last token
    assert whole.keep == 63 and (cache.stats.hits, cache.stats.tokens_restored) == (2, 64 + 63)
    # A whole cached prompt of exactly MIN_PREFIX_REUSE tokens leaves MIN_PREFIX_REUSE - 1 to
    # restore: below the threshold, computed instead.
    cache.put(None, tokens(7000, MIN_PREFIX_REUSE + BLOCK), "u", 32)
    assert take(tokens(7000, MIN_PREFIX_REUSE)).restore is None
    assert cache.stats.misses == 2


def test_a_slot_is_saved_from_one_block_up_unless_its_own_scope_already_holds_it():
    from localserve.engine.plan import StepPlan
    from localserve.engine.reuse import PrefixBook

    cache = PromptCache(10_000)
    pool = SlotPool(4096, 1)
    book, slot = PrefixBook(pool, cache), pool.slots[0]

    def saved(n: int, scope: str | None) -> bool:
        plan = StepPlan()
        slot.forget()
        slot.computed(tokens(1, n))
        slot.cache_scope = scope
        book.save(plan, slot)
        return [(s.scope, s.tokens) for s in plan.saves] == [(scope, tokens(1, n))]

    assert not saved(BLOCK - 1, "bob") and saved(BLOCK, "bob")
    cache.put("alice", tokens(1, BLOCK), "alice's", 1)
    assert saved(BLOCK, "bob")  # alice's copy is not bob's to restore
    cache.put("bob", tokens(1, BLOCK), "bob's", 1)
    assert not saved(BLOCK, "bob")


def test_a_stopping_loop_keeps_each_slots_sequence_not_already_kept_under_its_own_scope():
    cache, pool = PromptCache(10_000), SlotPool(4096, 3)
    sched = Scheduler(pool, FakeVocab(), 64, prompt_cache=cache)
    for slot, first, scope in zip(pool.slots, (1, 100), ("alice", "bob")):
        slot.computed(tokens(first, 40))
        slot.cache_scope = scope
    cache.put("bob", tokens(100, 40), "bob's, kept before", 1)
    read = []

    def read_sequence(slot_id):
        read.append(slot_id)
        return f"state of slot {slot_id}", 10 + slot_id
    sched.keep_sequences(read_sequence)  # the Protocol's call (PrefixBook.keep_slots)
    assert read == [0]  # bob's is kept already; the third slot holds nothing
    alice, shared = cache.lookup(tokens(1, 40), "alice")
    assert (alice.state, alice.nbytes, alice.tokens, shared) == ("state of slot 0", 10,
                                                                 tokens(1, 40), 40)
    assert cache.lookup(tokens(100, 40), "bob")[0].state == "bob's, kept before"
    assert cache.lookup(tokens(1, 40), None) is None  # kept for alice only


def test_the_disk_tier_counts_its_bytes_drops_the_oldest_file_and_forgets_an_unsound_one(tmp_path):
    from localserve.engine.prompt_disk import DiskTier

    def files() -> dict:
        return {f: f.stat().st_size for f in tmp_path.glob("*.cache")}

    assert PromptCache(10_000).spill() == 0  # no disk tier: nothing written
    one = 100  # each state's bytes
    cache = PromptCache(10_000, DiskTier(tmp_path, 100_000, "m"))
    for i in range(3):
        cache.put("alice", tokens(1000 * (i + 1), 40), bytes([i]) * one, one)
    assert cache.spill() == 3 and cache.disk_bytes == sum(files().values())
    size = max(files().values())
    again = PromptCache(10_000, DiskTier(tmp_path, 100_000, "m"))  # a restart reads the files
    assert again.disk_bytes == sum(files().values()) and again.nbytes == 0
    entries = [again.lookup(tokens(1000 * (i + 1), 40), "alice")[0] for i in range(3)]
    assert all(again.load(e) for e in entries[:2]) and again.stats.disk_reads == 2
    assert again.nbytes == 2 * one and entries[1].state == bytes([1]) * one
    bad = entries[2].path
    bad.write_bytes(bad.read_bytes()[:-1] + b"!")  # its checksum no longer holds
    assert not again.load(entries[2])  # read() deleted the file; the entry is forgotten
    assert again.lookup(tokens(3000, 40), "alice") is None and len(files()) == 2
    assert again.disk_bytes == sum(files().values())
    again.drop_scope("alice")
    assert (again.disk_bytes, again.nbytes, files()) == (0, 0, {})
    small = PromptCache(10_000, DiskTier(tmp_path, 2 * size, "m"))  # room for two files
    for i in range(3):
        small.put("bob", tokens(1000 * (i + 1), 40), bytes([i]) * one, one)
        small.spill()
    assert len(files()) == 2 and small.disk_bytes == sum(files().values())
    assert small.lookup(tokens(1000, 40), "bob") is None  # the oldest file went, and its entry
    assert small.lookup(tokens(3000, 40), "bob") is not None
