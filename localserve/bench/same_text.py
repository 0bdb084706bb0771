"""Two servers' copy runs compared on the text both wrote.

Greedy answers are not the same on every side: llama.cpp's numbers depend on how a step's
batch is made (a prompt computed whole or behind a reused prefix, a token decoded alone or
checked with drafts), and near a tie the next token flips. Measured on Gemma 3 270M, seed 0:
llama-server with and without ngram-mod agreed on 8 of 12 answers, localserve with and
without drafts on 6. A kind's tok/s over two answers then compares different work: one
answer loops and drafts 64 tokens a step, the other does not.

So each answer pair is cut to its common beginning, and each side is timed from sending the
request to having streamed that beginning: the same prompt and the same output tokens on both
sides, prefill included."""

from __future__ import annotations

import os


def covered_at(marks: list[tuple[int, float]], chars: int) -> float:
    """Seconds until the first `chars` characters had arrived (marks: (characters so far,
    seconds), in order)."""
    return next(seconds for so_far, seconds in marks if so_far >= chars)


def same_text_speedup(mine: list[dict], theirs: list[dict]) -> dict[str, dict]:
    """Per kind and overall ("all"): their time over mine to write the beginnings both answers
    share (> 1: mine is faster), the characters compared and the share of my answers' text
    they are. `mine` and `theirs` are copy runs' answers ({"kind", "text", "marks"}) to the
    same texts in the same order."""
    kinds: dict[str, dict] = {}
    for a, b in zip(mine, theirs, strict=True):
        shared = len(os.path.commonprefix([a["text"], b["text"]]))
        for kind in (a["kind"], "all"):
            row = kinds.setdefault(kind, {"mine_s": 0.0, "theirs_s": 0.0, "chars": 0, "of": 0})
            row["of"] += len(a["text"])
            if shared:
                row["chars"] += shared
                row["mine_s"] += covered_at(a["marks"], shared)
                row["theirs_s"] += covered_at(b["marks"], shared)
    return {kind: {"speedup": row["theirs_s"] / row["mine_s"] if row["mine_s"] else None,
                   "chars": row["chars"], "share": row["chars"] / row["of"] if row["of"] else 0.0}
            for kind, row in kinds.items()}
