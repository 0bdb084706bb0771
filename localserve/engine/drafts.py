"""N-gram speculative decoding inside continuous batching (prompt lookup; llama.cpp's ngram
drafts): a decoding request's latest n-gram is looked up in its own prompt and output, and
the tokens that followed it last time become drafts, extra rows of the same batch as everyone
else's. The runner samples each row with the request's own sampler chain and keeps drafts
while the sampled token equals the draft, so the output is exactly what decoding one token
at a time gives (greedy or sampled); rejected rows leave the cache. Copying answers (code
rewritten with a comment added, a document quoted or reformatted) get several tokens a step.

Pure Python. Drafts take only the step budget left after every decode row, prompt chunk and
admission (they never delay anyone), and each request's draft length follows its acceptance.
"""

from __future__ import annotations

NGRAMS = (4, 3, 2)  # the longest match first: fewer, better drafts
MAX_DRAFT = 8
FIRST_DRAFT = 4


class NgramDrafter:
    """One request's n-gram index: where each n-gram of its tokens last ended."""

    def __init__(self):
        self._last_end: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this index are in _last_end
        self.length = FIRST_DRAFT

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to min(limit, self.length) tokens that followed the latest n-gram's last
        earlier occurrence; [] when it never occurred."""
        n_total = len(tokens)
        for end in range(max(self._indexed, 1), n_total):  # the tail itself is indexed later
            for n in NGRAMS:
                if end >= n:
                    self._last_end[tuple(tokens[end - n:end])] = end
        self._indexed = n_total
        want = min(limit, self.length)
        if want <= 0:
            return []
        for n in NGRAMS:
            end = self._last_end.get(tuple(tokens[n_total - n:])) if n_total > n else None
            if end is not None:
                return tokens[end:end + want]
        return []

    def feedback(self, drafted: int, accepted: int) -> None:
        """All accepted: draft more next time; some rejected: draft one past what held.
        (Resting after misses was measured and dropped: it cost copying answers a quarter of
        their gain and saved ordinary chat nothing.)"""
        self.length = min(MAX_DRAFT, self.length * 2) if accepted == drafted else accepted + 1
