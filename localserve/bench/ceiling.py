"""The most drafting could buy on a copy answer: its lookup ceiling.

A prompt-lookup drafter (localserve's, llama.cpp's ngram-mod) drafts only tokens it finds in the
request's own context. One that also knew how far each lookup will hold would draft, every
step, the longest continuation of the answer found anywhere in the prompt or the answer so far,
as many tokens of it as pay for their rows. Replaying an answer that way, each step priced by
the server's own measured step costs, against the same answer decoded one token a step, bounds
what any such drafter gains on that text. Where a model rewrites what it copies (SmolLM2-135M
on CSV and Markdown tables) the bound is low, and a rule guessing from match lengths gets a
share of it: printed beside each kind's speed, it tells a shortfall of the rule's from one of
the text's.
"""

from __future__ import annotations

from typing import Callable

import httpx

MAX_DRAFT = 63  # drafts per step at most (a 64-row step)


def longest_run(context: list[int], answer: list[int], i: int) -> int:
    """How many of answer[i:] follow on from some place in `context` (the prompt and
    answer[:i]); a run reaching the end of the context goes on into the answer itself, as a
    copy of text that repeats does."""
    text, best = context + answer[i:], 0
    for start in range(len(context)):
        run = 0
        while i + run < len(answer) and text[start + run] == answer[i + run]:
            run += 1
        best = max(best, run)
    return best


def step_cost(step_ms: dict) -> Callable[[int], float]:
    """Seconds a step of n rows costs, interpolated from measured milliseconds by rows (past
    the largest measured: that one's cost per row)."""
    table = sorted((int(rows), ms / 1000) for rows, ms in step_ms.items())

    def cost(rows: int) -> float:
        below = [(n, s) for n, s in table if n <= rows] or table[:1]
        above = [(n, s) for n, s in table if n >= rows]
        (n0, s0) = below[-1]
        if not above:
            return s0 * rows / n0
        (n1, s1) = above[0]
        return s0 if n1 == n0 else s0 + (s1 - s0) * (rows - n0) / (n1 - n0)
    return cost


def lookup_ceiling(prompt: list[int], answer: list[int],
                   cost: Callable[[int], float]) -> tuple[float, float]:
    """Seconds to decode the answer after its first token (the prefill's) with foresight
    drafts, and one token a step."""
    drafted, plain, i = 0.0, 0.0, 1
    context = prompt + answer[:1]
    while i < len(answer):
        run = min(longest_run(context, answer, i), len(answer) - i - 1, MAX_DRAFT)
        k = max(range(run + 1), key=lambda k: (k + 1) * cost(1) - cost(1 + k))
        drafted += cost(1 + k)
        plain += (k + 1) * cost(1)  # summed alike: never below `drafted` by a rounding
        context += answer[i:i + k + 1]
        i += k + 1
    return drafted, plain


async def ceiling_by_kind(client: httpx.AsyncClient, url: str, answered: list[tuple],
                          step_ms: dict) -> dict[str, float]:
    """Per kind of text, over answers (kind, messages, answer text): the time one token a step
    over the time with foresight drafts (>= 1), priced by `step_ms` (the server's /slots
    table). Token ids from the server's /apply-template and /tokenize."""
    cost, times = step_cost(step_ms), {}

    async def ids(content: str, special: bool) -> list[int]:
        r = await client.post(url + "/tokenize", json={"content": content,
                                                         "add_special": special,
                                                         "parse_special": special})
        return r.json()["tokens"]
    for kind, messages, text in answered:
        r = await client.post(url + "/apply-template", json={"messages": messages})
        prompt = await ids(r.json()["prompt"], True)
        drafted, plain = lookup_ceiling(prompt, await ids(text, False), cost)
        total = times.setdefault(kind, [0.0, 0.0])
        total[0], total[1] = total[0] + drafted, total[1] + plain
    return {kind: plain / drafted for kind, (drafted, plain) in times.items() if drafted}
