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
- StepCost: what one more batch row costs, fitted from the engine's own decode times.
A draft row is worth adding while the tokens it is expected to keep (p^j for the j-th row)
are worth more than the time it adds at the step's own pace (decode rows per second).
The measured wall time only ever changes speed, never what a request is answered.

Pure Python. Drafts take only the step budget left after every decode row, prompt chunk and
admission (they never delay anyone's prompt).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

NGRAMS = (16, 8, 4, 2)  # looked up longest first: the match most likely to go on
MAX_DRAFT = 64  # llama-server's ngram-mod drafts up to 64 too
FIRST_DRAFT = 8
MATCH_CLASSES = (2, 4, 8, 16, 32)  # lower bounds of the match-length classes
LONGEST_MATCH = 64  # matches are measured up to this many tokens


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
        """Up to min(limit, self.length) tokens that followed the latest earlier occurrence
        of the longest n-gram the tail ends with; no tokens when none occurred."""
        n_total = len(tokens)
        for end in range(max(self._indexed, 1), n_total):  # the tail itself is indexed later
            for n in NGRAMS:
                if end >= n:
                    self._last_end[tuple(tokens[end - n:end])] = end
        self._indexed = n_total
        want = min(limit, self.length)
        self.match = 0
        if want > 0:
            for n in NGRAMS:
                end = self._last_end.get(tuple(tokens[n_total - n:])) if n_total > n else None
                if end is not None:
                    self.match = matched_length(tokens, end, n_total)
                    return Proposal(tokens[end:end + want], self.match)
        return Proposal([], 0)

    def feedback(self, drafted: int, accepted: int) -> None:
        """All accepted: draft more next time; some rejected: draft one past what held.
        (Resting after misses was measured and dropped: it cost copying answers a quarter of
        their gain and saved ordinary chat nothing.)"""
        self.length = min(MAX_DRAFT, self.length * 2) if accepted == drafted else accepted + 1


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
    each class starts from one hold and one miss (p = 0.5) so it is tried before it is known."""

    DECAY = 0.995  # per draft recorded: about the last 200 drafts of a class count

    def __init__(self):
        self.held = [1.0] * len(MATCH_CLASSES)
        self.missed = [1.0] * len(MATCH_CLASSES)

    def p(self, match: int) -> float:
        c = match_class(match)
        return self.held[c] / (self.held[c] + self.missed[c])

    def record(self, match: int, drafted: int, accepted: int) -> None:
        c = match_class(match)
        self.held[c] = self.held[c] * self.DECAY + accepted
        self.missed[c] = self.missed[c] * self.DECAY + (1 if accepted < drafted else 0)


class StepCost:
    """What one more batch row costs: the engine's llama_decode seconds fitted as
    base + per_row * rows (least squares over the last WINDOW steps of at most MAX_ROWS rows,
    the sizes drafts make; bigger prompt chunks would fit the compute-bound slope instead).
    Until the steps vary enough to fit, a row is taken to cost PRIOR_ROW_SHARE of a step."""

    WINDOW = 256
    MAX_ROWS = 2 * MAX_DRAFT
    PRIOR_ROW_SHARE = 0.1

    def __init__(self):
        self.steps: deque[tuple[int, float]] = deque(maxlen=self.WINDOW)

    def observe(self, rows: int, seconds: float) -> None:
        if 0 < rows <= self.MAX_ROWS and seconds > 0:
            self.steps.append((rows, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(base, per_row) seconds, or None while the rows have not varied (or fit nonsense)."""
        n = len(self.steps)
        if n < 8:
            return None
        mean_r = sum(r for r, _ in self.steps) / n
        mean_s = sum(s for _, s in self.steps) / n
        var = sum((r - mean_r) ** 2 for r, _ in self.steps)
        if var < n:  # rows spread by less than one on average: no slope to read
            return None
        per_row = sum((r - mean_r) * (s - mean_s) for r, s in self.steps) / var
        base = mean_s - per_row * mean_r
        return (base, per_row) if per_row > 0 and base > 0 else None

    def row_share(self, decode_rows: int) -> float:
        """What one more row adds to a step of `decode_rows` rows, as a share of that step."""
        fitted = self.fit()
        if fitted is None:
            return self.PRIOR_ROW_SHARE
        base, per_row = fitted
        return per_row / (base + per_row * decode_rows)

    def worth(self, p: float, decode_rows: int) -> int:
        """How many draft rows pay for themselves: the j-th row is expected to keep p^j
        tokens and costs row_share of a step that makes `decode_rows` tokens, so it pays
        while p^j >= row_share * decode_rows."""
        bar = self.row_share(decode_rows) * decode_rows
        if bar >= 1 or p <= 0:
            return 0
        if p >= 1:
            return MAX_DRAFT
        return min(MAX_DRAFT, int(math.log(bar) / math.log(p)))
