"""N-gram speculative decoding inside continuous batching (prompt lookup; llama.cpp's ngram
drafts): a decoding request's latest n-gram is looked up in its own prompt and output (the
whole conversation), and the tokens that followed it last time become drafts, extra rows of
the same batch as everyone else's. The runner samples each row with the request's own sampler
chain and keeps drafts while the sampled token equals the draft, so the output is exactly what
decoding one token at a time gives (greedy or sampled); rejected rows leave the cache.

How many drafts a row gets is decided every step from two measurements, so drafting is on by
default and stays out of the way where it does not pay:
- Acceptance: how often a draft token held, per class of match length (a 40-token match is
  text being copied; a 2-token match is a guess). Server-wide, decayed toward recent steps.
- StepCost: what a step of n rows costs, measured from the engine's own steps.
A request gets the number of drafts whose expected kept tokens (p + p^2 + ...) most exceed
what the time they add would have made by plain decoding, or none when no length does.
The measured wall time only ever changes speed, never what a request is answered.

Pure Python. Drafts take only the step budget left after every decode row, prompt chunk and
admission (they never delay anyone's prompt).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

NGRAMS = (16, 8, 4, 2)  # looked up longest first: the match most likely to go on
MAX_DRAFT = 64  # llama-server's ngram-mod drafts up to 64 too
FIRST_DRAFT = 8
# Drafts a step on a hybrid model (--spec ngram): llama.cpp keeps this many earlier states per
# slot for them (n_rs_seq, runner/model_file.rollback_states), each another copy of the slot's
# recurrent state in memory (kilobytes for LFM2's convolutions, megabytes a layer for Qwen3.5's
# delta-net). A window model drafts as many as an attention one (runner/core.py).
ROLLBACK_DRAFTS = 8
MATCH_CLASSES = (2, 4, 8, 16, 32)  # lower bounds of the match-length classes
LONGEST_MATCH = 64  # matches are measured up to this many tokens
COPYING = 16  # a match this long is text being copied: it earns drafts as long as itself


@dataclass
class Proposal:
    tokens: list[int]  # what followed the match last time (up to the limit asked for)
    match: int  # how many tokens before the tail equal those before that earlier spot


class NgramDrafter:
    """One request's n-gram index: where each n-gram of its tokens last ended; and its own
    draft length, which follows its acceptance (a request leaving a copied passage drafts
    little until it copies again)."""

    def __init__(self):
        self._last_end: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this index are in _last_end
        self.length = FIRST_DRAFT
        self.match = 0  # the last proposal's match length (for its acceptance class)

    def propose(self, tokens: list[int], limit: int) -> Proposal:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest
        n-gram the tail ends with (no tokens when none occurred): as many as this request's
        draft length, or as a match of COPYING tokens or more behind them. Such a match is
        text being copied, and copying goes on past a miss (an edit in the copy): climbing back
        from a short length after it costs a step per doubling, each of few tokens, where
        llama.cpp's ngram-mod drafts 48-64 tokens behind every 24-token match."""
        n_total = len(tokens)
        for end in range(self._indexed, n_total):  # the tail itself is indexed later
            for n in NGRAMS:
                if end >= n:
                    self._last_end[tuple(tokens[end - n:end])] = end
        self._indexed = n_total
        self.match = 0
        if limit > 0:
            for n in NGRAMS:
                end = self._last_end.get(tuple(tokens[n_total - n:])) if n_total > n else None
                if end is not None:
                    self.match = matched_length(tokens, end, n_total)
                    copied = self.match if self.match >= COPYING else 0
                    want = min(limit, max(self.length, copied))
                    return Proposal(continued(tokens, end, want), self.match)
        return Proposal([], 0)

    def feedback(self, drafted: int, accepted: int) -> None:
        """All accepted: draft more next time; some rejected: draft one past what held.
        (Resting after misses was measured and dropped: it cost copying answers a quarter of
        their gain and saved ordinary chat nothing.)"""
        self.length = min(MAX_DRAFT, self.length * 2) if accepted == drafted else accepted + 1


def continued(tokens: list[int], end: int, want: int) -> list[int]:
    """`want` tokens from `end` on, past the tail too: a match that ends `period` tokens
    before the tail is text repeating itself with that period (a list, a table's rows, a
    loop), and drafts it on (as llama.cpp's ngram-mod, which chains its lookups)"""
    draft = tokens[end:end + want]
    period = len(tokens) - end
    while len(draft) < want:
        draft.append(draft[-period])
    image = next((i for i, token in enumerate(draft) if token < 0), None)
    return draft if image is None else draft[:image]  # an image's rows are never drafted


def matched_length(tokens: list[int], earlier_end: int, tail_end: int) -> int:
    """How many tokens before `earlier_end` equal those before `tail_end` (up to LONGEST_MATCH)."""
    n = 0
    while (n < LONGEST_MATCH and n < earlier_end
           and tokens[earlier_end - 1 - n] == tokens[tail_end - 1 - n]):
        n += 1
    return n


def match_class(match: int) -> int:
    return sum(1 for bound in MATCH_CLASSES[1:] if match >= bound)


class Acceptance:
    """How often a draft token holds, per match-length class, as the chance p that the next
    draft holds when the one before it did (each draft is a run of holds ended by a miss or
    by its end: p = holds / (holds + misses)). Counts decay so p follows recent traffic;
    each class starts from one hold and two misses (p = 1/3: a class is tried, not trusted).

    Decisions use a draw of p from what the counts allow (Thompson sampling: Beta(holds,
    misses)), not the mean: a class with few or old counts is sometimes drafted anyway, so a
    bad start never stops it being measured again; a well-measured class draws near its mean."""

    DECAY = 0.995  # per draft recorded: about the last 200 drafts of a class count

    def __init__(self, seed: int = 0):
        self.held = [1.0] * len(MATCH_CLASSES)
        self.missed = [2.0] * len(MATCH_CLASSES)
        self._random = random.Random(seed)  # deterministic per engine: speed only, never output

    def p(self, match: int) -> float:
        c = match_class(match)
        return self.held[c] / (self.held[c] + self.missed[c])

    def draw(self, match: int) -> float:
        c = match_class(match)
        return self._random.betavariate(self.held[c] + 0.01, self.missed[c] + 0.01)

    def view(self) -> dict[str, float]:
        """Each class's p, by its match lengths ("2-3", ..., "32+"), for /slots."""
        bounds = (*MATCH_CLASSES[1:], None)
        return {f"{lo}-{hi - 1}" if hi else f"{lo}+": round(self.p(lo), 3)
                for lo, hi in zip(MATCH_CLASSES, bounds)}

    def record(self, match: int, drafted: int, accepted: int) -> None:
        c = match_class(match)
        self.held[c] = self.held[c] * self.DECAY + accepted
        self.missed[c] = self.missed[c] * self.DECAY + (1 if accepted < drafted else 0)


class StepCost:
    """What a step of n batch rows costs, from the engine's own steps of decode and draft rows
    (DraftBook.timed): the latest seconds (an average that follows recent steps) at each of
    SIZES, interpolated between them.
    Measured, not assumed: on a 2-core CPU with a 135M model a step of 2-16 rows costs
    several times a one-row step (each row is compute), while rows past 32 come cheaper each
    (llama.cpp's batched matrix kernels); a GPU's curve is flat. A size not yet seen is
    interpolated from its neighbours, or past the largest seen costs what that one cost, so
    drafts try it and then know. (Priced per row past the largest, the long drafts copying
    pays for were seldom tried on a fresh server: replaying 60 SmolLM2 copy answers with step
    times drawn from measured ones, 84 tok/s against 90 with this rule, 92 once learnt.)"""

    SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    DRAFTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # draft lengths weighed
    FOLLOW = 0.2  # weight of the newest step in a size's average
    MIN_SURPLUS = 0.1  # tokens a draft must gain beyond its time's worth (what the table
    # cannot see: the cache trim after a miss, the bookkeeping)

    def __init__(self):
        self.seconds: dict[int, float] = {}
        self._known: list[tuple[int, float]] = []  # (size, seconds) made non-decreasing

    def observe(self, rows: int, seconds: float) -> None:
        """A step's rows and seconds; one larger than any size (a prompt prefilled 1,024 rows
        at a time while nothing decodes) is no draft's size and would price 256 rows at four
        times their cost."""
        if not 0 < rows <= self.SIZES[-1] or seconds <= 0:
            return
        size = min(self.SIZES, key=lambda s: abs(math.log(s / rows)))
        if size not in self.seconds:
            self.seconds[size] = seconds
        else:
            self.seconds[size] += self.FOLLOW * (seconds - self.seconds[size])
        self._known, most = [], 0.0
        for n, t in sorted(self.seconds.items()):  # never cheaper for more rows: steps of
            most = max(most, t)  # different contexts must not make a row look free
            self._known.append((n, most))

    def view(self) -> dict[int, float]:
        """Measured milliseconds by batch size, for /slots."""
        return {rows: round(s * 1000, 2) for rows, s in sorted(self.seconds.items())}

    def step(self, rows: int) -> float:
        """Seconds a step of `rows` rows is expected to take (before any step is measured,
        every size costs the same: drafts are tried, then measured)."""
        known = self._known
        if not known:
            return 1.0
        below = [(n, t) for n, t in known if n <= rows]
        above = [(n, t) for n, t in known if n >= rows]
        if not below:
            return known[0][1]
        if not above:  # past the largest size seen: its cost, until tried
            return known[-1][1]
        (n0, t0), (n1, t1) = below[-1], above[0]
        return t0 if n0 == n1 else t0 + (t1 - t0) * (rows - n0) / (n1 - n0)

    def worth(self, p: float, rows: int, made: int, available: int) -> int:
        """How many drafts (at most `available`) to add to `rows` decode and draft rows, of
        which `made` decode rows: the length whose expected kept tokens (p + p^2 + ... + p^k)
        most exceed what the time they add would make by plain decoding (made tokens per
        step(made) seconds); 0 unless that surplus is at least MIN_SURPLUS tokens. Prompt
        chunks in the same step are left out: they cost the same with or without drafts."""
        if available <= 0 or p <= 0 or made <= 0:
            return 0
        plain_rate, base = made / self.step(made), self.step(rows)
        best, best_surplus, expected, last = 0, self.MIN_SURPLUS, 0.0, 0
        for k in self.DRAFTS:
            if k > available:
                break
            expected += sum(p ** j for j in range(last + 1, k + 1))
            last = k
            surplus = expected - plain_rate * (self.step(rows + k) - base)
            if surplus > best_surplus:
                best, best_surplus = k, surplus
        return best
