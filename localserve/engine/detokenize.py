"""Turn a stream of token pieces (bytes) into safe text deltas, and cut at stop strings.

Two hazards, both handled here so the scheduler stays simple:
- a multi-byte UTF-8 character can be split over two tokens; the incremental decoder holds
  the incomplete tail until the next piece completes it, so no broken character escapes;
- a stop string can be split over tokens; text that might be the start of a stop string is
  held back until it is either completed (and dropped) or ruled out (and released).
"""

from __future__ import annotations

import codecs


class IncrementalDetokenizer:
    def __init__(self, stop: tuple[str, ...] = ()):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._held = ""  # decoded text not yet released: a possible stop-string prefix
        self.stopped = False  # True once a stop string matched; nothing more is released

    def feed(self, piece: bytes) -> str:
        """Add one token's bytes; return the text now safe to send (may be empty)."""
        if self.stopped:
            return ""
        self._held += self._decoder.decode(piece)
        return self._release()

    def flush(self) -> str:
        """End of generation: release whatever is held (an unfinished character becomes U+FFFD)."""
        if self.stopped:
            return ""
        text = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return text

    def _release(self) -> str:
        if not self._stop:
            text, self._held = self._held, ""
            return text
        cut = min((i for i in (self._held.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            text, self._held = self._held[:cut], ""
            return text
        keep = self._longest_stop_prefix_suffix()
        text = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep:]
        return text

    def _longest_stop_prefix_suffix(self) -> int:
        """Length of the longest tail of the held text that begins some stop string."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self._held)), best, -1):
                if self._held.endswith(stop[:n]):
                    best = n
                    break
        return best
