"""Office-shaped workloads, for `localserve bench --workload doc|copy` against any server and
for bench/office.py's side-by-side rounds against llama-server:

  doc   "chat with my document": colleagues each with their own ~1,050-token document, a
        question then two follow-ups in the same conversation, every colleague's next turn
        after all the others' (more conversations than slots: what the prompt cache is for).
  longdoc the same with fewer colleagues (16) and longer documents (~1,800 tokens: four of
        them, the slots llama-server keeps by default, still fit its 8,192-token pool).
  copy  "rewrite this exactly, adding a line at the top": texts of several kinds, none of them
        this repository's (bench/corpus.py), a different set per seed, with figures per kind
        (what speculative decoding is for).
  agents a coding agent's ~5,000-token system prompt (instructions and tool schemas, different
        per seed) shared by 4 colleagues, 4 turns each (what one pool and the prompt cache are
        for: it does not fit a slot's share of -c).
  office the office's own assistant: one ~400-word system prompt (different per seed) shared
        by 24 colleagues, 4 short questions each, 8 at a time (what prefix reuse across
        colleagues and the prompt cache are for). In both, each colleague first says who
        they are: no two conversations are the same past the system prompt.

Each reports what the engine did too, read from localserve's /slots (drafted tokens, the share
kept, tokens per decode step, prompt tokens reused); another server reports speeds only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import math
import random
import statistics
import time

import httpx

from localserve.bench.ceiling import ceiling_by_kind
from localserve.bench.corpus import INSTRUCTION, KINDS, CopyText, copy_corpus

WORDS = ("invoice supplier warehouse schedule budget contract clause delivery quarterly "
         "forecast tender audit payroll reimbursement inventory compliance margin freight "
         "customs deadline revision approval signature").split()
QUESTIONS = ("What is this document about?", "Which dates does it mention?",
             "Summarise the second paragraph.")


def document(colleague: int, seed: int = 0, paragraphs: int = 11) -> str:
    """A colleague's document of `paragraphs` 90-word paragraphs (11: ~1,050 tokens),
    different for every seed (round) and length."""
    rng = random.Random(f"{seed}:{colleague}" + (f":{paragraphs}" if paragraphs != 11 else ""))
    body = [" ".join(rng.choice(WORDS) for _ in range(90)) + "." for _ in range(paragraphs)]
    return f"Document of colleague {colleague}.\n\n" + "\n\n".join(body)


@dataclasses.dataclass
class Streamed:
    """One streamed answer: its text, when each piece of it arrived ((characters so far,
    seconds since the request was sent), what bench.same_text compares), its usage and
    timings (llama-server's draft counts), whether it failed, and how long it took."""
    text: str
    marks: list[tuple[int, float]]
    usage: dict
    timings: dict
    failed: bool
    seconds: float

    @property
    def first_token_s(self) -> float:
        return self.marks[0][1] if self.marks else self.seconds


async def stream(client, url: str, body: dict) -> Streamed:
    """POST a chat completion streamed. It fails with an error status or an error in its
    stream (llama-server's "Context size has been exceeded" when its pool is full comes that
    way, after a 200)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start, text, marks, usage, timings, chars = time.perf_counter(), [], [], {}, {}, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        failed = r.status_code != 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            failed = failed or "error" in chunk
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices") or []:
                piece = choice["delta"].get("content")
                if piece:
                    text.append(piece)
                    chars += len(piece)
                    marks.append((chars, time.perf_counter() - start))
    return Streamed("".join(text), marks, usage, timings, failed, time.perf_counter() - start)


async def turn(client, url, messages) -> tuple[float, str, dict, bool]:
    """One conversation turn: (time to first token, text, usage, failed)."""
    body = {"messages": messages, "max_tokens": 32, "temperature": 0}
    answer = await stream(client, url, body)
    return answer.first_token_s, answer.text, answer.usage, answer.failed


AGENT_QUESTIONS = ("List the files of the project.", "Open README.md and summarise it.",
                   "Which tool runs the tests?", "Write a commit message for the last change.")


def agent_prompt(seed: int = 0, n_tools: int = 16) -> str:
    """A coding agent's ~5,000-token system prompt: rules, then tool schemas (as agents send
    them), different for every seed."""
    rng = random.Random(f"agents:{seed}")
    say = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    tools = [{"type": "function", "function": {
        "name": f"{rng.choice(WORDS)}_{i}", "description": say(40),
        "parameters": {"type": "object", "properties": {
            f"{rng.choice(WORDS)}_{j}": {"type": "string", "description": say(10)}
            for j in range(4)}}}} for i in range(n_tools)]
    rules = "\n".join(f"- {say(25)}." for _ in range(12))
    return f"You are a coding agent.\n# Rules\n{rules}\n# Tools\n{json.dumps(tools, indent=1)}"


async def agents_workload(url: str, colleagues: int = 4, headers: dict | None = None,
                          seed: int = 0) -> dict:
    """4 colleagues on one agent's system prompt, 4 turns each, all at once."""
    return await conversations_workload(url, [agent_prompt(seed)] * colleagues, AGENT_QUESTIONS,
                                        colleagues, headers, signed=True)


COLLEAGUES = ("Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas",
              "Kemi", "Luca", "Mira", "Noor", "Oskar", "Priya", "Quentin", "Rosa", "Sami", "Tara",
              "Umar", "Vera", "Wen", "Yusuf")
OFFICE_QUESTIONS = ("Who do I ask about a late delivery?", "How do I book the meeting room?",
                    "When is the quarterly budget due?", "Thanks. Anything else I should know?")


def office_prompt(seed: int = 0) -> str:
    """The office assistant's ~400-word system prompt, different for every seed."""
    rng = random.Random(f"office:{seed}")
    rules = [" ".join(rng.choice(WORDS) for _ in range(20)) + "." for _ in range(19)]
    return "You are the office assistant. Answer briefly.\n" + "\n".join(f"- {r}" for r in rules)


async def office_workload(url: str, colleagues: int = 24, concurrency: int = 8,
                          headers: dict | None = None, seed: int = 0) -> dict:
    """24 colleagues on the office assistant's system prompt, 4 turns each, 8 at a time."""
    return await conversations_workload(url, [office_prompt(seed)] * colleagues,
                                        OFFICE_QUESTIONS, concurrency, headers, signed=True)


async def doc_workload(url: str, colleagues: int = 24, concurrency: int = 8,
                       headers: dict | None = None, seed: int = 0) -> dict:
    return await conversations_workload(url, [document(c, seed) for c in range(colleagues)],
                                        QUESTIONS, concurrency, headers)


async def longdoc_workload(url: str, colleagues: int = 16, concurrency: int = 8,
                           headers: dict | None = None, seed: int = 0) -> dict:
    return await conversations_workload(
        url, [document(c, seed, paragraphs=19) for c in range(colleagues)], QUESTIONS,
        concurrency, headers)


async def conversations_workload(url: str, systems: list[str], questions, concurrency: int,
                                 headers: dict | None, signed: bool = False) -> dict:
    """A conversation per system prompt; each turn's question goes to every conversation
    before the next turn's. Turns answered per minute, follow-up time to first token (p50),
    prompt tokens and those reused; failed turns are counted apart and in neither figure.
    `signed`: colleagues sharing a system prompt say who they are in their first question, so
    that no two conversations are the same past the system prompt (as in an office; the same
    greedy conversation 24 times would be computed once by any cache)."""
    chats = [[{"role": "system", "content": system}] for system in systems]
    if signed:
        for number, chat in enumerate(chats):
            chat.append({"role": "user", "content": f"I am {COLLEAGUES[number % len(COLLEAGUES)]} "
                                                    f"(desk {number + 1})."})
            chat.append({"role": "assistant", "content": "Hello! How can I help?"})
    followup_ttft, prompt, cached, turns, failed = [], 0, 0, 0, 0
    gate = asyncio.Semaphore(concurrency)
    # A fresh connection per turn (a turn takes seconds, a local connect well under one ms):
    # llama-server closes kept-alive connections on its own schedule, and a turn sent on one
    # in that race is dropped ("Server disconnected"), even when reused after under 1 s.
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=900, headers=headers, limits=limits) as client:
        started = time.perf_counter()
        for round_no, question in enumerate(questions):
            async def one(chat):
                nonlocal prompt, cached, turns, failed
                async with gate:
                    chat.append({"role": "user", "content": question})
                    ttft, text, usage, refused = await turn(client, url, chat)
                    chat.append({"role": "assistant", "content": text})
                    if refused:
                        failed += 1
                        return
                    turns += 1
                    prompt += usage.get("prompt_tokens", 0)
                    cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    if round_no:
                        followup_ttft.append(ttft)
            await asyncio.gather(*(one(chat) for chat in chats))
        wall = time.perf_counter() - started
    return {"turns_per_min": turns / wall * 60, "failed_turns": failed,
            "followup_ttft_p50_s": statistics.median(followup_ttft) if followup_ttft else math.nan,
            "prompt_tokens": prompt, "cached_tokens": cached, "wall_s": wall}


def speed_by_kind(done: list[tuple[str, int, Streamed]]) -> dict[str, dict]:
    """Per kind, over its answers (kind, tokens, answer): tok/s from each request to its last
    piece (prefill included), and decoding tok/s, the tokens after each first piece over the
    time from it to the last: each side's own whole answers, where the text both wrote
    (same_text) may be a few characters (a 135M model rewrites a table's rows its own way,
    differently on each server) and then measures a step or two."""
    kinds: dict[str, dict] = {}
    for kind, n, answer in done:
        figures = kinds.setdefault(kind, {"tokens": 0, "seconds": 0.0, "decoded": 0,
                                          "decoding_s": 0.0})
        figures["tokens"] += n
        figures["seconds"] += answer.seconds
        if len(answer.marks) > 1:
            figures["decoded"] += n - 1
            figures["decoding_s"] += answer.marks[-1][1] - answer.marks[0][1]
    for figures in kinds.values():
        figures["tok_s"] = figures["tokens"] / figures["seconds"]
        decoded, decoding_s = figures.pop("decoded"), figures.pop("decoding_s")
        figures["decoding_tok_s"] = decoded / decoding_s if decoding_s else None
    return kinds


async def copy_workload(url: str, concurrency: int, texts: list[CopyText],
                        headers: dict | None = None) -> dict:
    """Output tok/s over one request per text, per kind of text too (each request's tokens
    over its own time: at concurrency 1 the kind's speed), and what speculation did: drafted
    tokens, the share kept, output tokens per decode step (localserve: its engine counters;
    llama-server: each answer's timings.draft_n / draft_n_accepted), and each answer with
    when its pieces came (same_text compares two servers on the text both wrote); localserve
    also each kind's lookup ceiling (ceiling.py), priced by its own measured step costs."""
    def body(text: CopyText) -> dict:
        return {"messages": [{"role": "user", "content": INSTRUCTION + text.text}],
                "max_tokens": 256, "temperature": 0}
    gate, drafted, kept = asyncio.Semaphore(concurrency), 0, 0
    done: list[tuple[str, int, Streamed]] = []  # (kind, its tokens, the answer) per answer
    answers: dict[int, dict] = {}  # text's place -> its answer and when each piece came
    # A connection each: llama-server may close one just after a streamed answer, and a
    # request sent on it then fails ("Server disconnected without sending a response").
    fresh = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=900, headers=headers, limits=fresh) as client:
        async def one(place: int, text: CopyText):
            nonlocal drafted, kept
            async with gate:
                answer = await stream(client, url, body(text))
                done.append((text.kind, answer.usage["completion_tokens"], answer))
                answers[place] = {"kind": text.kind, "text": answer.text, "marks": answer.marks}
                drafted += answer.timings.get("draft_n", 0)
                kept += answer.timings.get("draft_n_accepted", 0)
        await one(-1, CopyText("warm-up", "def warm_up():\n    return 1\n"))  # not counted
        done.clear()
        answers.clear()
        drafted = kept = 0
        before = await engine_counters(client, url)
        started = time.perf_counter()
        await asyncio.gather(*(one(place, text) for place, text in enumerate(texts)))
        wall = time.perf_counter() - started
        after = await engine_counters(client, url)
        ceilings = await ceiling_by_kind(client, url, [
            (text.kind, body(text)["messages"], answers[place]["text"])
            for place, text in enumerate(texts)], after["step_ms"]) if after else {}
    if before and after:  # localserve
        drafted = after["draft_tokens"] - before["draft_tokens"]
        kept = after["draft_tokens_accepted"] - before["draft_tokens_accepted"]
    tokens = sum(n for _, n, _ in done)
    steps = after["steps"] - before["steps"] if before and after else None
    kinds = speed_by_kind(done)
    for kind, ceiling in ceilings.items():
        kinds[kind]["lookup_ceiling"] = ceiling
    return {"tok_s": tokens / wall, "completion_tokens": tokens, "drafted": drafted,
            "accepted": kept / drafted if drafted else 0.0, "kinds": kinds,
            "tokens_per_step": tokens / steps if steps else None,
            "draft_held": after.get("draft_held") if after else None,
            "step_ms": after.get("step_ms") if after else None,
            "answers": [answers[place] for place in sorted(answers)]}


# The workloads of colleagues in conversations, by name: each called as (url, colleagues,
# headers=, seed=), its defaults the workload's own (its default colleagues the most it takes).
CONVERSATIONS = {"doc": doc_workload, "longdoc": longdoc_workload, "office": office_workload,
                 "agents": agents_workload}


async def engine_counters(client, url: str) -> dict | None:
    """localserve's engine counters (None from a server that has none)."""
    try:
        r = await client.get(url + "/slots?view=full")
        return r.json()["engine"] if r.status_code == 200 else None
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return None




def run(url: str, workload: str, levels: list[int], seed: int, api_key: str | None,
        requests: int) -> dict:
    """`localserve bench --workload doc|longdoc|office|agents|copy`: one run against a server,
    printed."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    if workload in CONVERSATIONS:
        workload_fn = CONVERSATIONS[workload]
        most = inspect.signature(workload_fn).parameters["colleagues"].default
        out = asyncio.run(workload_fn(url, min(requests, most), headers=headers, seed=seed))
        print(f"{workload}: {out['turns_per_min']:.1f} turns/min, follow-up time to first token "
              f"p50 {out['followup_ttft_p50_s']:.2f} s, {out['cached_tokens']} of "
              f"{out['prompt_tokens']} prompt tokens reused from earlier turns"
              + (f"; {out['failed_turns']} turns FAILED" if out["failed_turns"] else ""))
        return out
    out = {}
    for level in levels:
        per_kind = -(-min(requests, 12) // len(KINDS))  # at most 12 texts, interleaved kinds
        texts = copy_corpus(seed, per_kind)[:requests]
        run_ = out[level] = asyncio.run(copy_workload(url, level, texts, headers))
        steps = (f", {run_['tokens_per_step']:.2f} tokens per decode step"
                 if run_["tokens_per_step"] else "")
        print(f"copy at concurrency {level}: {run_['tok_s']:.1f} tok/s; {run_['drafted']} tokens "
              f"drafted, {run_['accepted']:.0%} kept{steps}")
        print("  by kind (tok/s of each answer): " + ", ".join(
            f"{kind} {v['tok_s']:.1f}" + (f" ({v['decoding_tok_s']:.1f} decoding)"
                                          if v["decoding_tok_s"] else "")
            for kind, v in run_["kinds"].items()))
        if any("lookup_ceiling" in v for v in run_["kinds"].values()):
            print("  drafting's ceiling on decoding, by kind (drafts from the context, "
                  "knowing how far each holds): " + ", ".join(
                      f"{kind} {v['lookup_ceiling']:.2f}x" for kind, v in run_["kinds"].items()
                      if "lookup_ceiling" in v))
    last = out[levels[-1]]
    if last.get("step_ms"):
        print("drafts held, by match length: " + ", ".join(
            f"{k} {v:.2f}" for k, v in last["draft_held"].items()))
        print("step milliseconds, by batch rows: " + ", ".join(
            f"{k}: {v:.1f}" for k, v in last["step_ms"].items()))
    return out
