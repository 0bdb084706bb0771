#!/usr/bin/env python3
"""Greedy answers of localserve and llama-server on one model file, one request at a time: a
conversation's turn 1, its follow-up, Regenerate, turn 1 again, then seven colleagues at once
(every slot taken), the conversation's next turn brought back, and the one after. Each side
runs its own defaults (-t alone given); printed: each answer equal or where it parts, and the
cached prompt tokens each side reported, of the prompt's.

llama.cpp's numbers depend on how a prompt's rows are batched, and a random-weight model's
near-ties turn the last bits into another token: equal text means both sides computed the same
rows in the same calls (reuse.prompt_stops). Where one side reuses more of its cache than the
other, the two compute different rows and may part.

With --self: each side against itself, on two fresh servers: the conversation with the seven
colleagues and without them (the same turns otherwise), and turn 1 again against turn 1.
Where the two servers part, this says whose text the colleagues (or a reuse) changed.

With --beside (issue 82, item 3): four greedy probes of 48 tokens, each alone and then sent
with 3, 5 and 7 colleagues' sampled requests; printed per side: how many of the 12 gave the
text alone, per round. A row's attention there spans the cells its neighbours hold too, unless
the server keeps a cache stream per slot (llama-server at an explicit -np).

    bench/run greedy [--model FILE] [--llama-server "$(scripts/build-llama-server)"] [-t 2]
        [--localserve-args "-np 4"] [--self] [--beside [--rounds 2] [--llama-server-args "-np 4"]]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from conftest import RunningServer  # noqa: E402
from localserve.common.config import resolve_model  # noqa: E402
from office import peer_template  # noqa: E402

SYSTEM = "You answer the office's questions about its rooms, its printers and its schedule. " * 4
QUESTIONS = ("Which printer is on the second floor?", "And who books the meeting rooms?",
             "Thanks. When does the office close?", "And on Fridays?")


def chat(url: str, messages: list[dict], max_tokens: int) -> tuple[str, str]:
    r = httpx.post(url + "/v1/chat/completions", timeout=600, json={
        "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    body = r.json()
    usage = body["usage"]
    return body["choices"][0]["message"]["content"], \
        f'{usage["prompt_tokens_details"]["cached_tokens"]} of {usage["prompt_tokens"]}'


async def colleagues(url: str, count: int) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*[client.post(url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": f"Colleague {i} asks about room {i * 7}."}],
            "max_tokens": 8, "temperature": 0}) for i in range(count)])


PROBES = ("The capital of France is", "Write a short poem about the sea.",
          "List three uses of a paperclip.", "Explain what a cache is, in two sentences.")
NEIGHBOURS = (3, 5, 7)


async def ask(client: httpx.AsyncClient, url: str, content: str, greedy: bool, seed: int) -> str:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 48 if greedy else 96}
    body.update({"temperature": 0} if greedy else {"temperature": 1.0, "seed": seed})
    r = await client.post(url + "/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


async def probe_beside(url: str, probe: str, n: int, seed: int) -> str:
    """The probe's text, sent with n colleagues' sampled requests."""
    async with httpx.AsyncClient(timeout=600) as client:
        answers = await asyncio.gather(
            ask(client, url, probe, True, 0),
            *[ask(client, url, f"Tell colleague {i} a story about room {seed + i}.", False,
                  seed + i) for i in range(n)])
    return answers[0]


def equal_beside(url: str, seed: int) -> dict[str, int]:
    """Per probe: how many of its runs beside 3, 5 and 7 neighbours gave its text alone. The
    text alone is its second run alone: the first computes the whole prompt, later ones find
    it cached (both servers) and compute its last token only, as the runs beside others do."""
    alone = {p: [asyncio.run(probe_beside(url, p, 0, seed)) for _ in range(2)][-1]
             for p in PROBES}
    return {p: sum(asyncio.run(probe_beside(url, p, n, seed + 100 * n)) == alone[p]
                   for n in NEIGHBOURS) for p in PROBES}


def conversation(url: str, max_tokens: int, with_colleagues: bool = True
                 ) -> list[tuple[str, str, str]]:
    """(step, answer, "cached of prompt tokens") for each step of the module's conversation;
    without the colleagues, the same steps with nothing between turn 1 again and turn 3."""
    steps = []

    def turn(name, messages):
        answer, cached = chat(url, messages, max_tokens)
        steps.append((name, answer, cached))
        return messages + [{"role": "assistant", "content": answer}]

    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    second = turn("turn 1", first) + [{"role": "user", "content": QUESTIONS[1]}]
    third = turn("follow-up", second) + [{"role": "user", "content": QUESTIONS[2]}]
    turn("regenerate", second)
    turn("turn 1 again", first)
    if with_colleagues:
        asyncio.run(colleagues(url, 7))
    fourth = turn("turn 3 after 7", third) + [{"role": "user", "content": QUESTIONS[3]}]
    turn("turn 4", fourth)
    return steps


def side(program: list[str] | None, args: list[str], name: str, work):
    """`work(url)` on one server, started and stopped around it."""
    srv = RunningServer(*args, log_name=f"greedy-{name}", program=program).wait_ready(300)
    try:
        return work(srv.url)
    finally:
        srv.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the embedded model)")
    parser.add_argument("--llama-server", default=None,
                        help="llama-server's path (default: scripts/build-llama-server's)")
    parser.add_argument("-t", "--threads", default="2")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--localserve-args", default="")
    parser.add_argument("--llama-server-args", default="")
    parser.add_argument("--self", action="store_true",
                        help="each side against itself: with the colleagues and without them")
    parser.add_argument("--beside", action="store_true",
                        help="probes alone and beside sampled colleagues, not the conversation")
    parser.add_argument("--rounds", type=int, default=1, help="--beside: rounds per side")
    args = parser.parse_args()
    peer = args.llama_server or subprocess.run(
        [str(ROOT / "scripts/build-llama-server")], check=True, capture_output=True,
        text=True).stdout.strip()
    model = str(resolve_model(args.model))
    common = ["-m", model, "-t", args.threads]
    if args.self:
        theirs = [peer], [*common, *peer_template(model), *shlex.split(args.llama_server_args)]
        mine = None, [*common, *shlex.split(args.localserve_args)]
        print_self({name: [side(program, argv, f"{name}-{kind}",
                                lambda url, kind=kind: conversation(url, args.max_tokens, kind))
                           for kind in (True, False)]
                    for name, (program, argv) in (("llama-server", theirs),
                                                  ("localserve", mine))})
        return 0
    if args.beside:
        def work(url):
            return [equal_beside(url, 1000 * r) for r in range(args.rounds)]
    else:
        def work(url):
            return conversation(url, args.max_tokens)
    theirs = side([peer], [*common, *peer_template(model), *shlex.split(args.llama_server_args)],
                  "llama-server", work)
    mine = side(None, [*common, *shlex.split(args.localserve_args)], "localserve", work)
    if args.beside:
        print_beside({"llama-server": theirs, "localserve": mine})
        return 0
    for (step, a, ca), (_, b, cb) in zip(mine, theirs):
        parts = len(os.path.commonprefix([a, b]))
        verdict = "equal" if a == b else f"parts at {parts} of {len(b)} characters"
        print(f"{step:15s} {verdict:32s} cached: localserve {ca}, llama-server {cb}")
    print(f"{sum(a == b for (_, a, _), (_, b, _) in zip(mine, theirs))} of {len(mine)} equal")
    return 0


def print_self(results: dict[str, list[list[tuple[str, str, str]]]]) -> None:
    """Per side: turn 1 again against turn 1, and each turn after the colleagues against the
    same turn without them."""
    for name, (beside, alone) in results.items():
        answers = {step: answer for step, answer, _ in beside}
        verdicts = [f"turn 1 again {'=' if answers['turn 1'] == answers['turn 1 again'] else '!='}"
                    " turn 1"]
        verdicts += [f"{step} {'=' if a == b else '!='} without them"
                     for (step, a, _), (_, b, _) in zip(beside[4:], alone[4:])]
        print(f"{name:13s} " + "; ".join(verdicts))


def print_beside(results: dict[str, list[dict]]) -> None:
    total = len(PROBES) * len(NEIGHBOURS)
    for name, rounds in results.items():
        counts = [sum(r.values()) for r in rounds]
        per_probe = ", ".join(f"{sum(r[p] for r in rounds)}" for p in PROBES)
        print(f"{name:13s} {' / '.join(map(str, counts))} of {total} the same as alone "
              f"(per probe, all rounds: {per_probe})")


if __name__ == "__main__":
    sys.exit(main())
