"""Two servers' copy runs compared on the text both wrote.

Greedy answers are not the same on every side: llama.cpp's numbers depend on how a step's
batch is made (a prompt computed whole or behind a reused prefix, a token decoded alone or
checked with drafts), and near a tie the next token flips. Measured on Gemma 3 270M, seed 0:
llama-server with and without ngram-mod agreed on 8 of 12 answers, localserve with and
without drafts on 6. A kind's tok/s over two answers then compares different work: one
answer loops and drafts 64 tokens a step, the other does not.

So each answer pair is cut to its common beginning, and each side is timed from sending the
request to having streamed that beginning: the same prompt and the same output tokens on both
sides, prefill included. And from each side's first streamed piece to the same point: the
decoding alone, where a long prompt's prefill (the same on both sides) does not dilute what
the drafts did."""

from __future__ import annotations

import os


def covered_at(marks: list[tuple[int, float]], chars: int) -> float:
    """Seconds until the first `chars` characters had arrived (marks: (characters so far,
    seconds), in order)."""
    return next(seconds for so_far, seconds in marks if so_far >= chars)


def same_text_speedup(mine: list[dict], theirs: list[dict]) -> dict[str, dict]:
    """Per kind and overall ("all"): their time over mine to write the beginnings both answers
    share (> 1: mine is faster), the same counted from each side's first piece ("decoding"),
    the characters compared and the share of my answers' text they are. `mine` and `theirs`
    are copy runs' answers ({"kind", "text", "marks"}) to the same texts in the same order."""
    kinds: dict[str, dict] = {}
    for a, b in zip(mine, theirs, strict=True):
        shared = len(os.path.commonprefix([a["text"], b["text"]]))
        times = [covered_at(answer["marks"], shared) if shared else 0.0 for answer in (a, b)]
        decoding = [t - answer["marks"][0][1] if shared else 0.0 for t, answer in zip(times, (a, b))]
        for kind in (a["kind"], "all"):
            row = kinds.setdefault(kind, {"mine_s": 0.0, "theirs_s": 0.0, "mine_decoding_s": 0.0,
                                          "theirs_decoding_s": 0.0, "chars": 0, "of": 0})
            row["of"] += len(a["text"])
            row["chars"] += shared
            row["mine_s"] += times[0]
            row["theirs_s"] += times[1]
            if min(decoding) > 0:  # past both first pieces: some decoding to compare
                row["mine_decoding_s"] += decoding[0]
                row["theirs_decoding_s"] += decoding[1]
    return {kind: {"speedup": ratio(row["theirs_s"], row["mine_s"]),
                   "decoding": ratio(row["theirs_decoding_s"], row["mine_decoding_s"]),
                   "chars": row["chars"], "share": row["chars"] / row["of"] if row["of"] else 0.0}
            for kind, row in kinds.items()}


def ratio(theirs: float, mine: float) -> float | None:
    return theirs / mine if mine else None
