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
the least recently used entries go first.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from localserve.engine.slots import common_prefix_len

BLOCK = 16  # tokens per hashed block: a prefix is found to the block, then measured exactly


@dataclass(eq=False)
class CachedPrompt:
    scope: str | None
    tokens: list[int]
    state: object  # the runner's serialized sequence (a ctypes buffer): opaque here
    nbytes: int
    entry_id: int = 0
    hashes: list[int] = field(default_factory=list)


def block_hashes(tokens: list[int]) -> list[int]:
    """Chained hashes of the full blocks: block i's hash stands for tokens[:(i+1) * BLOCK]."""
    out, h = [], 0
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        h = hash((h, *tokens[start:start + BLOCK]))
        out.append(h)
    return out


@dataclass
class CacheStats:
    hits: int = 0  # lookups that found a prefix worth restoring
    misses: int = 0
    saves: int = 0
    evictions: int = 0
    tokens_restored: int = 0


class PromptCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, CachedPrompt] = OrderedDict()  # least recently used first
        self._index: dict[tuple[str | None, int], set[int]] = {}  # (scope, block hash) -> ids
        self._ids = itertools.count(1)
        self.nbytes = 0
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, tokens: list[int], scope: str | None) -> tuple[CachedPrompt, int] | None:
        """The entry of `scope` sharing the longest prefix with `tokens`, and that prefix's
        length (at least one block), or None. Touches the entry (most recently used)."""
        found: set[int] | None = None
        for h in block_hashes(tokens):
            ids = self._index.get((scope, h))
            if not ids:
                break
            found = ids
        if not found:
            return None
        entry = self.entries[max(found)]  # ids grow with each put: the newest of equals
        self.entries.move_to_end(entry.entry_id)
        return entry, common_prefix_len(entry.tokens, tokens)

    def holds(self, tokens: list[int], scope: str | None) -> bool:
        """Is this exact sequence (or a longer one starting with it) already kept?"""
        found = self.lookup(tokens, scope)
        return found is not None and found[1] == len(tokens)

    def put(self, scope: str | None, tokens: list[int], state: object, nbytes: int) -> None:
        """Keep a sequence; an entry it extends (a conversation's earlier turn) goes. An entry
        larger than the whole bound is not kept."""
        if nbytes > self.max_bytes or len(tokens) < BLOCK:
            return
        older = self.lookup(tokens, scope)
        if older is not None and older[1] == len(older[0].tokens):
            self.remove(older[0])
        entry = CachedPrompt(scope, list(tokens), state, nbytes, next(self._ids),
                             block_hashes(tokens))
        self.entries[entry.entry_id] = entry
        for h in entry.hashes:
            self._index.setdefault((scope, h), set()).add(entry.entry_id)
        self.nbytes += nbytes
        self.stats.saves += 1
        while self.nbytes > self.max_bytes:
            self.remove(next(iter(self.entries.values())))
            self.stats.evictions += 1

    def remove(self, entry: CachedPrompt) -> None:
        if self.entries.pop(entry.entry_id, None) is None:
            return
        self.nbytes -= entry.nbytes
        for h in entry.hashes:
            ids = self._index.get((entry.scope, h))
            if ids is not None:
                ids.discard(entry.entry_id)
                if not ids:
                    del self._index[(entry.scope, h)]

    def drop_scope(self, scope: str) -> int:
        """Forget everything a key cached (the key was removed); returns how many entries."""
        gone = [e for e in self.entries.values() if e.scope == scope]
        for entry in gone:
            self.remove(entry)
        return len(gone)
