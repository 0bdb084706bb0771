#!/usr/bin/env python3
"""Office-shaped traffic against localserve and llama.cpp's llama-server (same llama.cpp, same
model, same -c/-np/-t), in alternating rounds, medians and spreads printed:

  doc   "chat with my document": 24 colleagues, each with their own ~1,050-token document
        (different each round), 8 at a time; each asks a question, then two follow-ups in the
        same conversation, every colleague's next turn coming after all the others have had
        theirs (more conversations than slots: what a cache beyond the slots is for). Turns
        per minute, follow-up time to first token (p50), prompt tokens reused.
  longdoc the same with 16 colleagues and ~1,800-token documents (four still fit
        llama-server's 8,192-token default pool).
  copy  "rewrite this exactly, adding a line at the top": 2 texts (--texts-per-kind) of each
        of six kinds, none of them this repository's (localserve/bench/corpus.py: Python, C,
        prose, JSON, CSV, Markdown), different each round, at concurrency 1 and 4: output
        tok/s, overall and per kind (what speculative decoding is for), drafted tokens, the
        share kept, and (localserve) output tokens per decode step; llama-server also with
        --spec-type ngram-mod. Greedy answers differ between servers, so ratios are also given
        on the text both sides wrote (each pair of answers cut to its common beginning,
        localserve/bench/same_text.py), from the request and from the first token (decoding alone), and
        per kind on each side's own whole answers from the first token (where answers part
        early, as the 135M model's on tables, the text both wrote is a step or two).
  chat  ordinary chat (short questions, 32-256-token answers, 24 requests, different each
        round) at concurrency 8 (--concurrency for others):
        output tok/s (what nothing may lose: compare localserve sides with and without a flag).
  mixed `localserve bench`'s prompt-heavy workload (30-400-word prompts, 16-128-token answers,
        24 requests, different each round) at concurrency 8 (--concurrency for others).
  agents a coding agent's ~5,000-token system prompt with tools (different each round) shared
        by 4 colleagues, 4 turns each: turns per minute and follow-up time to first token.
  office the office assistant's ~400-word system prompt (different each round) shared by 24
        colleagues, 4 short questions each, 8 at a time: turns per minute and follow-up time
        to first token. In both, each colleague first says who they are (no two conversations
        are the same past the system prompt; before December 4, 2026 they were).

Both sides run -c 32768 -np 8 unless --defaults leaves each server its own defaults, and the
embedded model unless --model names another .gguf file (one that carries no chat template:
llama-server is given the one localserve falls back to, so that both answer the same prompts).

    bench/run office --workload doc|longdoc|office|agents|copy|chat|mixed [--rounds 3] \
        [--concurrency 1 4 8] \
        [--llama-server "$(scripts/build-llama-server)"] [--localserve-args "--spec ngram"]...

Each --localserve-args adds a localserve side with those flags (leading NAME=value words set its
environment); ratios are the first side's.

--paired: every side's server is up at once and works alone in turn, on the same jobs, the
order rotated every round. For chat, mixed and copy a round is --waves (3) x concurrency jobs
(seconds, not minutes), so the drift of a shared machine falls on every side alike and many
more rounds fit; --waves 1 at concurrency 1 pairs single answers: the finest pairing there is.
For doc, longdoc, office and agents a round is the whole workload (its own documents or prompts), each
side's run minutes apart rather than a fresh server per side and round.

Run it alone on the machine: llama.cpp's worker threads spin, so anything beside it skews it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import RunningServer  # noqa: E402

from localserve.bench import load as bench  # noqa: E402
from localserve.bench.corpus import KINDS, copy_corpus  # noqa: E402
from localserve.models.gguf_meta import template_for_peer  # noqa: E402
from localserve.bench.office import CONVERSATIONS, copy_workload  # noqa: E402
from localserve.bench.report import spread  # noqa: E402
from localserve.bench.same_text import same_text_speedup  # noqa: E402
from localserve.common.config import resolve_model  # noqa: E402

SPLIT = ("-c", "32768", "-np", "8")
# words in, tokens out
CHAT_SHAPES = {"chat": ((10, 60), (32, 256)), "mixed": ((30, 400), (16, 128))}


def servers(args) -> dict[str, list[str] | None]:
    """name -> extra arguments (None marks llama-server)."""
    out = {("localserve " + flags).strip(): ["up", *flags.split()]
           for flags in args.localserve_args or [""]}
    if args.llama_server:
        out["llama-server"] = []
        if args.workload == "copy":
            out["llama-server ngram-mod"] = ["--spec-type", "ngram-mod"]
    return out


def start(name: str, extra: list[str], args) -> RunningServer:
    common = (*(() if args.defaults else SPLIT), "-t", str(args.threads))
    model = ("-m", str(resolve_model(args.model)))
    if name.startswith("llama-server"):
        return RunningServer(*model, *common, *peer_template(model[1]), *extra,
                             log_name="office-llama", program=[args.llama_server]).wait_ready(300)
    # Leading NAME=value words set the side's environment, as in a shell: e.g.
    # "LLAMA_CPP_LIB_PATH=/tmp/lib --spec off" runs that side on another build of llama.cpp.
    flags = extra[1:]
    env = list(itertools.takewhile(lambda flag: "=" in flag and not flag.startswith("-"), flags))
    return RunningServer(*common, *(model if args.model else ()), *flags[len(env):],
                         log_name="office-local",
                         program=["env", *env, sys.executable, "-m", "localserve", extra[0]]
                         ).wait_ready(300)


@functools.cache
def peer_template(model: str) -> tuple[str, ...]:
    """--chat-template-file for llama-server where the model file carries no template: each
    server falls back to its own otherwise (llama-server to ChatML, localserve to the model
    family's, Gemma's for a Gemma file), and the two would answer different prompts. Read
    once per bench: every round starts llama-server again."""
    source = template_for_peer(model)
    if source is None:
        return ()
    path = Path(tempfile.gettempdir()) / f"bench-template-{os.getpid()}.jinja"
    path.write_text(source, encoding="utf-8")
    return ("--chat-template-file", str(path))


def run_once(name, extra, args, seed: int) -> dict:
    """One side's run of the workload; `seed` varies the texts and prompts between rounds
    (both sides of a round get the same)."""
    srv = start(name, extra, args)
    try:
        if args.workload in CONVERSATIONS:
            return conversations(srv.url, args, seed)
        if args.workload in CHAT_SHAPES:
            jobs = bench.make_workload(24, seed, *CHAT_SHAPES[args.workload])
            asyncio.run(bench.run_level(srv.url, jobs[:2], 2))  # warm-up
            return {f"c{c}": asyncio.run(bench.run_level(srv.url, jobs, c)).output_tok_s
                    for c in args.concurrency}
        out = {}
        texts = copy_corpus(seed, per_kind=args.texts_per_kind or 2)
        for c in args.concurrency:
            out.update(copy_row(f"c{c}", asyncio.run(copy_workload(srv.url, c, texts))))
        return out
    finally:
        srv.stop()


def copy_row(key: str, run: dict) -> dict:
    """A copy run's figures: tok/s overall and per kind, each with its answers' tokens (equal
    answers: equal counts), and what the drafts did."""
    row = {key: run["tok_s"], key + "_tokens": run["completion_tokens"],
           key + "_accepted": run["accepted"], key + "_drafted": run["drafted"],
           key + "_answers": run["answers"]}
    row.update({f"{key}:{kind}": v["tok_s"] for kind, v in run["kinds"].items()})
    row.update({f"{key}:{kind}_tokens": v["tokens"] for kind, v in run["kinds"].items()})
    row.update({f"{key}:{kind}_decoding": v["decoding_tok_s"] for kind, v in run["kinds"].items()
                if v["decoding_tok_s"]})
    row.update({f"{key}:{kind}_ceiling": v["lookup_ceiling"] for kind, v in run["kinds"].items()
                if "lookup_ceiling" in v})  # localserve's: drafting's ceiling on decoding
    if run["tokens_per_step"] is not None:
        row[key + "_tokens_per_step"] = run["tokens_per_step"]
    return row


def conversations(url: str, args, seed: int) -> dict:
    """One side's whole conversation workload (doc, longdoc, office, agents) on `seed`'s documents or
    prompts: a fresh-server round, or a paired one."""
    return asyncio.run(CONVERSATIONS[args.workload](url, seed=seed))


def run_rounds(sides: dict, args) -> dict[str, list[dict]]:
    """A fresh server per side and round, the order reversed every other round."""
    results: dict[str, list[dict]] = {name: [] for name in sides}
    for round_no in range(args.rounds):
        order = list(sides.items()) if round_no % 2 == 0 else list(sides.items())[::-1]
        for name, extra in order:
            results[name].append(run_once(name, extra, args, seed=round_no))
            print(f"round {round_no + 1} {name}: {shown(results[name][-1])}", flush=True)
    return results


def shown(row: dict) -> dict:
    """A round's figures without the copy answers' texts (kept for same_text and --out)."""
    return {k: v for k, v in row.items() if not k.endswith("_answers")}


def print_same_text(first: str, peer: str, results: dict[str, list[dict]], key: str) -> None:
    """Copy rounds compared on the text both sides wrote (localserve/bench/same_text.py): medians over
    rounds of each kind's speedup, from the request and from the first piece (decoding
    alone), and how much of the answers that text is."""
    rounds = [same_text_speedup(a[key + "_answers"], b[key + "_answers"])
              for a, b in zip(results[first], results[peer])]
    for figure, says in (("speedup", "on the text both wrote"),
                         ("decoding", "decoding the text both wrote")):
        cells = []
        for kind in sorted(rounds[0], key=lambda kind: kind != "all"):
            ups = [r[kind][figure] for r in rounds if r[kind][figure] is not None]
            share = statistics.median(r[kind]["share"] for r in rounds)
            cells.append(f"{kind} {statistics.median(ups):.2f}x ({min(ups):.2f}-{max(ups):.2f}; "
                         f"{share:.0%} of the text)" if ups else f"{kind}: nothing shared")
        print(f"    {key} {says}: " + ", ".join(cells))


def paired_level(url: str, args, round_no: int, concurrency: int) -> dict:
    """One side's output tok/s on a paired round's jobs at one level: the first --waves x
    concurrency of the round's jobs (chat and mixed prompts, or copy passages); for copy also
    per kind, and the answers' tokens (copy_row: llama-server's ngram-mod does not always
    answer what greedy decoding does, and a shorter answer is mostly time to first token)."""
    n, most, key = args.waves * concurrency, args.waves * max(args.concurrency), f"c{concurrency}"
    if args.workload == "copy":
        if args.texts_per_kind:
            texts = copy_corpus(round_no, per_kind=args.texts_per_kind)
        else:
            texts = copy_corpus(round_no, per_kind=-(-most // len(KINDS)))[:n]
        return copy_row(key, asyncio.run(copy_workload(url, concurrency, texts)))
    jobs = bench.make_workload(most, round_no, *CHAT_SHAPES[args.workload])[:n]
    return {key: asyncio.run(bench.run_level(url, jobs, concurrency)).output_tok_s}


def paired_round(url: str, args, round_no: int) -> dict:
    """One side's share of a paired round: a conversation workload whole, or each level's
    jobs (paired_level)."""
    if args.workload in CONVERSATIONS:
        return conversations(url, args, round_no)
    row = {}
    for c in args.concurrency:
        row.update(paired_level(url, args, round_no, c))
    return row


def run_paired(sides: dict, args) -> dict[str, list[dict]]:
    """Rounds every side takes in turn (rotated) on the same jobs, with all servers up (an
    idle one waits without spinning): a few seconds each, or a whole conversation workload."""
    up = {name: start(name, extra, args) for name, extra in sides.items()}
    try:
        for srv in up.values():  # warm-up
            asyncio.run(bench.run_level(srv.url, bench.make_workload(2, 999), 2))
        results: dict[str, list[dict]] = {name: [] for name in up}
        for round_no in range(args.rounds):
            names = list(up)[round_no % len(up):] + list(up)[:round_no % len(up)]
            for name in names:
                results[name].append(paired_round(up[name].url, args, round_no))
            print(f"round {round_no + 1}: " + ", ".join(
                f"{name} {shown(results[name][-1])}" for name in up), flush=True)
        return results
    finally:
        for srv in up.values():
            srv.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=[*CONVERSATIONS, "copy", *CHAT_SHAPES], default="doc")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=None,
                    help="concurrency levels for copy (default 1 4), chat and mixed (default 8)")
    ap.add_argument("--llama-server", help="path to llama-server (scripts/build-llama-server)")
    ap.add_argument("--localserve-args", action="append",
                    help="flags for a localserve side (repeat for several sides)")
    ap.add_argument("--paired", action="store_true",
                    help="chat, mixed, copy: all servers up, short rounds rotated (see above)")
    ap.add_argument("--waves", type=int, default=3,
                    help="--paired: jobs per round and level, in multiples of its concurrency")
    ap.add_argument("--texts-per-kind", type=int,
                    help="copy: texts of each kind a round (default 2; --paired: --waves x "
                         "concurrency texts, kinds in turn)")
    ap.add_argument("--defaults", action="store_true",
                    help="no -c/-np on any side: each server's own defaults (both take the "
                         "context from the model)")
    ap.add_argument("--model", help="a .gguf file for every side (default: the embedded model)")
    ap.add_argument("--out", default="bench-out/office.json")
    args = ap.parse_args()
    args.concurrency = args.concurrency or ([8] if args.workload in CHAT_SHAPES else [1, 4])
    sides = servers(args)
    results = (run_paired if args.paired else run_rounds)(sides, args)
    first = next(iter(results))
    print(f"\n{args.workload}: medians of {args.rounds} alternating rounds (min-max)")
    for name, runs in results.items():
        keys = [k for k in shown(runs[0]) if k not in ("prompt_tokens", "cached_tokens", "wall_s")]
        # a figure some round lacks (a kind whose answers decoded nothing): the other rounds'
        cells = [f"{k} {spread([r[k] for r in runs if k in r], unit='')}" for k in keys]
        if "cached_tokens" in runs[0]:
            cells.append(f"reused {statistics.median(r['cached_tokens'] for r in runs):.0f} of "
                         f"{statistics.median(r['prompt_tokens'] for r in runs):.0f} prompt tokens")
        print(f"  {name:24s} " + "; ".join(cells))
    speeds = [k for k in results[first][0]
              if k in ("tok_s", "turns_per_min")
              or (k[0] == "c" and k[1:].split(":")[0].isdigit() and "_" not in k)]
    for name, runs in results.items():
        failed = [r.get("failed_turns", 0) for r in runs]
        if any(failed):
            print(f"  {name}: {sum(failed)} turns FAILED ({', '.join(map(str, failed))} a round): "
                  f"its turns/min counts the answered ones only")
    for peer in [n for n in results if n != first]:
        for k in speeds:
            ratios = [a[k] / b[k] for a, b in zip(results[first], results[peer])]
            print(f"  {first} / {peer} {k}: {spread(ratios)}")
            if k + "_tokens" in results[first][0]:  # paired copy: rounds with the same answers
                same = [r for r, a, b in zip(ratios, results[first], results[peer])
                        if a[k + "_tokens"] == b[k + "_tokens"]]
                print(f"    same answer length in {len(same)} of {len(ratios)} rounds"
                      + (f": {spread(same)}" if same else ""))
            if k + "_answers" in results[first][0]:
                print_same_text(first, peer, results, k)
            decoding = [a[k + "_decoding"] / b[k + "_decoding"]  # rounds where both decoded
                        for a, b in zip(results[first], results[peer])
                        if k + "_decoding" in a and k + "_decoding" in b]
            if decoding:
                print(f"    decoding its own answers, from the first piece: {spread(decoding)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
