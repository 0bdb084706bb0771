"""The prompt cache beyond the slots (llama-server's --cache-ram): sequences a slot is about to
lose (another prompt takes the slot, or a preemption) are kept in RAM with their token ids, and
a later request that starts with one of them gets it restored into its slot instead of
computing it again. An office has more conversations than slots: this is what lets a
colleague's document survive the others' turns.

Pure Python: the store holds each sequence's state as an opaque object (the runner's bytes),
and finds the longest cached prefix by hashed fixed-size token blocks (vLLM's prefix-caching
design), so a lookup costs one hash per block of the prompt whatever the number of entries.
Entries are private to a cache scope (one API key unless --shared-prefix-cache): the index is
keyed by scope, so one key's prompts are never found, nor timed, by another. Bounded in bytes;
the least recently used entries go first: to the disk tier when there is one (prompt_disk.py,
--cache-disk), else away. One index covers both tiers; an entry found on disk is read back
into RAM (load()) before the scheduler plans its restore.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from localserve.engine.prompt_disk import DiskTier
from localserve.engine.slots import common_prefix_len

BLOCK = 16  # tokens per hashed block: a prefix is found to the block, then measured exactly


@dataclass(eq=False)
class CachedPrompt:
    scope: str | None
    tokens: list[int]
    state: object | None  # the runner's serialized sequence, in RAM; None: on disk only
    nbytes: int  # the state's size
    entry_id: int = 0
    hashes: list[int] = field(default_factory=list)
    path: Path | None = None  # its file, once written to the disk tier
    disk_bytes: int = 0


def within(entry_scope: str | None, scope: str) -> bool:
    """Is `entry_scope` the key `scope`, or one of the colleagues it speaks for (a trusted
    frontend's `scope:colleague`)?"""
    return entry_scope == scope or (entry_scope or "").startswith(scope + ":")


def block_hashes(tokens: list[int]) -> list[int]:
    """Chained hashes of the full blocks: block i's hash stands for tokens[:(i+1) * BLOCK]."""
    out, h = [], 0
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        h = hash((h, *tokens[start:start + BLOCK]))
        out.append(h)
    return out


@dataclass
class CacheStats:
    hits: int = 0  # admissions that restored a prefix from the cache
    misses: int = 0
    saves: int = 0
    evictions: int = 0  # entries that left RAM (to disk, or away)
    tokens_restored: int = 0
    disk_writes: int = 0
    disk_reads: int = 0


class PromptCache:
    """`whole_only`: the model's cache cannot be cut back to a prefix (a recurrent or window
    state, slots.SlotPool.cuts_back): an entry is found only where all of it starts the
    prompt, and one that a longer entry extends stays (a checkpoint to come back to)."""

    def __init__(self, max_bytes: int, disk: DiskTier | None = None, whole_only: bool = False):
        self.max_bytes, self.disk, self.whole_only = max_bytes, disk, whole_only
        self.ram: OrderedDict[int, CachedPrompt] = OrderedDict()  # least recently used first
        self.on_disk: OrderedDict[int, CachedPrompt] = OrderedDict()  # entries with a file
        self._index: dict[tuple[str | None, int], set[int]] = {}  # (scope, block hash) -> ids
        self._ids = itertools.count(1)
        self.nbytes = self.disk_bytes = 0
        self.stats = CacheStats()
        for path, header, size in disk.scan() if disk else ():
            self._add(CachedPrompt(header["scope"], header["tokens"], None,
                                   header["state_bytes"], path=path, disk_bytes=size))

    def __len__(self) -> int:
        return len(self.ram.keys() | self.on_disk.keys())

    def _entry(self, entry_id: int) -> CachedPrompt:
        return self.ram.get(entry_id) or self.on_disk[entry_id]

    def lookup(self, tokens: list[int], scope: str | None) -> tuple[CachedPrompt, int] | None:
        """The entry of `scope` sharing the longest prefix with `tokens` (whole_only: the
        longest entry that all of it starts `tokens`), and that prefix's length (at least one
        block), or None. Touches the entry (most recently used)."""
        first, found = self._matching(tokens, scope)
        if not found:
            return None
        entry = self._longest_whole(first, tokens) if self.whole_only else self._entry(max(found))
        if entry is None:
            return None
        for tier in (self.ram, self.on_disk):
            if entry.entry_id in tier:
                tier.move_to_end(entry.entry_id)
        return entry, common_prefix_len(entry.tokens, tokens)

    def shared(self, tokens: list[int], scope: str | None) -> int:
        """The longest prefix `tokens` share with any entry of `scope`, whole or not (0: less
        than a block); touches nothing."""
        _, found = self._matching(tokens, scope)
        return common_prefix_len(self._entry(max(found)).tokens, tokens) if found else 0

    def _matching(self, tokens: list[int], scope: str | None) -> tuple[set | None, set | None]:
        """The ids of the entries sharing the first block with `tokens`, and of those sharing
        the most blocks."""
        first: set[int] | None = None
        found: set[int] | None = None
        for h in block_hashes(tokens):
            ids = self._index.get((scope, h))
            if not ids:
                break
            first, found = first or ids, ids
        return first, found

    def _longest_whole(self, ids: set[int], tokens: list[int]) -> CachedPrompt | None:
        """Among `ids` (every entry sharing the first block), the longest that `tokens` start
        with; the newest of equals."""
        whole = [e for e in map(self._entry, ids)
                 if len(e.tokens) <= len(tokens) and tokens[:len(e.tokens)] == e.tokens]
        return max(whole, key=lambda e: (len(e.tokens), e.entry_id), default=None)

    def holds(self, tokens: list[int], scope: str | None) -> bool:
        """Is this exact sequence (or a longer one starting with it) already kept?"""
        found = self.lookup(tokens, scope)
        return found is not None and found[1] == len(tokens)

    def put(self, scope: str | None, tokens: list[int], state: object, nbytes: int) -> None:
        """Keep a sequence; an entry it extends (a conversation's earlier turn) goes. An entry
        larger than the whole bound is not kept."""
        if nbytes > self.max_bytes or len(tokens) < BLOCK:
            return
        older = None if self.whole_only else self.lookup(tokens, scope)
        if older is not None and older[1] == len(older[0].tokens):
            self.remove(older[0])
        self._add(CachedPrompt(scope, list(tokens), state, nbytes))
        self.stats.saves += 1

    def load(self, entry: CachedPrompt) -> bool:
        """Make sure the entry's state is in RAM (read from its file if need be); False if the
        file turned out unsound (it is then deleted, and the entry forgotten)."""
        if entry.state is not None:
            return True
        sound = self.disk.read(entry.path)
        if sound is None or sound[1] and len(sound[1]) > self.max_bytes:
            self.remove(entry)
            return False
        entry.state = sound[1]
        self.stats.disk_reads += 1
        self.ram[entry.entry_id] = entry
        self.nbytes += entry.nbytes
        self._trim_ram(keep=entry)
        return True

    def spill(self) -> int:
        """Write every entry only in RAM to the disk tier (clean shutdown, unload)."""
        if self.disk is None:
            return 0
        written = [e for e in list(self.ram.values()) if e.path is None and self._write(e)]
        return len(written)

    def remove(self, entry: CachedPrompt) -> None:
        in_ram = self.ram.pop(entry.entry_id, None) is not None
        on_disk = self.on_disk.pop(entry.entry_id, None) is not None
        if not (in_ram or on_disk):
            return
        if in_ram:
            self.nbytes -= entry.nbytes
        if on_disk:
            self.disk_bytes -= entry.disk_bytes
            entry.path.unlink(missing_ok=True)
        for h in entry.hashes:
            ids = self._index.get((entry.scope, h))
            if ids is not None:
                ids.discard(entry.entry_id)
                if not ids:
                    del self._index[(entry.scope, h)]

    def drop_scope(self, scope: str) -> int:
        """Forget everything a key cached, files too (the key was removed); how many entries."""
        return self._remove_where(lambda entry: within(entry.scope, scope))

    def keep_scopes(self, live) -> int:
        """At start: delete what keys removed while the server was down cached (a later key
        of the same name must not inherit it): entries whose scope `live(scope)` refuses.
        How many entries went."""
        return self._remove_where(lambda entry: not live(entry.scope))

    def _remove_where(self, condition) -> int:
        gone = {e.entry_id: e for e in [*self.ram.values(), *self.on_disk.values()] if condition(e)}
        for entry in gone.values():
            self.remove(entry)
        return len(gone)

    def _add(self, entry: CachedPrompt) -> None:
        entry.entry_id, entry.hashes = next(self._ids), block_hashes(entry.tokens)
        for h in entry.hashes:
            self._index.setdefault((entry.scope, h), set()).add(entry.entry_id)
        if entry.path is not None:
            self.on_disk[entry.entry_id] = entry
            self.disk_bytes += entry.disk_bytes
        if entry.state is not None:
            self.ram[entry.entry_id] = entry
            self.nbytes += entry.nbytes
            self._trim_ram(keep=entry)

    def _trim_ram(self, keep: CachedPrompt) -> None:
        """Least recently used first: to disk when there is a disk tier, else away."""
        while self.nbytes > self.max_bytes:
            oldest = next(e for e in self.ram.values() if e is not keep)
            self.stats.evictions += 1
            if oldest.path is None and not (self.disk and self._write(oldest)):
                self.remove(oldest)
                continue
            del self.ram[oldest.entry_id]
            self.nbytes -= oldest.nbytes
            oldest.state = None

    def _write(self, entry: CachedPrompt) -> bool:
        written = self.disk.write(entry.scope, entry.tokens, entry.state)
        if written is None:
            return False
        entry.path, entry.disk_bytes = written
        self.on_disk[entry.entry_id] = entry
        self.disk_bytes += entry.disk_bytes
        self.stats.disk_writes += 1
        while self.disk_bytes > self.disk.max_bytes and self.on_disk:
            self.remove(next(iter(self.on_disk.values())))
        return entry.entry_id in self.on_disk
