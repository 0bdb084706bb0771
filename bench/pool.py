#!/usr/bin/env python3
"""What one colleague's use of the one pool costs another (hardening round 6), measured on the
real server at its defaults (8,192 cells, 6 slots, `-t 2`), keys alice, bob and carol:

1. chat: carol's short chat, time to first token, alone; 1 s after alice sends a new
   4,000-token prompt; and queued behind bob's 2,200-token document that cannot fit yet
   beside alice's long answer (a 6,300-token document, 600 tokens out)
2. flood: alice's 6,300-token document with a 600-token answer (over 5/6 of the pool),
   start to end, alone and while bob and carol chat back to back; with the pool's saves and
   restores (/metrics) during it.
3. four: alice runs four 700-token documents with 300-token answers; bob's new 700-token
   document's time to first token against the time of one of alice's answers.
4. title: carol's follow-up about a 2,000-word message, time to first token, alone and sent
   just after Open WebUI's title task for the same chat (which asks `max_tokens: 1000`), and
   the title's length (`--task-max-tokens` bounds it).
5. farm (hardening round 7, case 2): alice's new 2,500-token prompt, time to first token,
   alone and while bob sends 1-token chats back to back on 1 and on 3 connections.

Each round makes new texts (nothing cached from an earlier round), the conditions of a case
alternate their order round by round; medians of the rounds, with the spread.

    bench/run pool [--rounds 3] [--only chat|flood|four|title|farm]
Run it alone on the machine: llama.cpp's threads spin, and any other load skews it.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import httpx  # noqa: E402
from conftest import key_file, running  # noqa: E402  (the tests' own start/stop helpers)

KEYS = {name: f"{name}-pool-bench-0001" for name in ("alice", "bob", "carol", "admin")}
CLIENT = httpx.Client(timeout=900)  # made once: a client's set-up costs the bench's own CPU
TITLE = ("### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat "
         "history.\n### Output:\nJSON format: { \"title\": \"your concise title here\" }\n"
         "### Chat History:\n<chat_history>\nUSER: {user}\nASSISTANT: {assistant}\n"
         "</chat_history>")


def auth(name: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def words(seed: str, n: int) -> str:
    """n words of the Python docs' prose from a place the seed picks: real text, new each round."""
    from pydoc_data.topics import topics
    pool = re.findall(r"[A-Za-z][a-z]+", " ".join(topics.values()))
    rng = random.Random(seed)
    start = rng.randrange(len(pool) - n)
    return f"[{seed}] " + " ".join(pool[start:start + n])


def question(seed: str) -> list[dict]:
    """A short chat nobody sent before: its own system words too, so that no condition finds
    the template's default opening cached and another not."""
    return [{"role": "system", "content": words(seed + "s", 8)},
            {"role": "user", "content": words(seed, 16) + "? Say hello."}]


def chat(url: str, name: str, content, max_tokens: int, long: bool = False) -> dict:
    """One streamed chat: its first-token and end times (from sending), tokens, and text."""
    messages = content if isinstance(content, list) else [{"role": "user", "content": content}]
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}, **({"ignore_eos": True} if long else {})}
    started, first, text, usage = time.monotonic(), None, [], {}
    with CLIENT.stream("POST", url + "/v1/chat/completions", json=body, headers=auth(name)) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.monotonic() - started
                    text.append(piece)
    return {"first": first, "end": time.monotonic() - started, "text": "".join(text),
            "completion": usage.get("completion_tokens"), "prompt": usage.get("prompt_tokens")}


def in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(fn(*args, **kwargs)), daemon=True)
    thread.start()
    return thread, result


def counters(url: str) -> dict[str, float]:
    """The pool's preemptions and the prompt cache's saves and restores, from /metrics."""
    text = CLIENT.get(url + "/metrics", headers=auth("admin")).text
    wanted = ("num_preemptions", "num_share_preemptions", "num_borrow_preemptions",
              "prompt_cache_saves", "prompt_cache_hits", "prompt_cache_tokens_restored")
    found = {}
    for line in text.splitlines():
        for name in wanted:
            if re.match(rf"^[\w:]*{name}(_total)?(\{{[^}}]*\}})? ", line):
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def in_turn(r: int, *conditions: str) -> list[str]:
    """A round's conditions, in reverse order every other round."""
    return list(conditions if r % 2 == 0 else reversed(conditions))


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def case_chat(url: str, rounds: int) -> None:
    alone, beside_long, behind = [], [], []
    for r in range(rounds):
        for condition in in_turn(r, "alone", "long", "behind"):
            if condition == "alone":
                alone.append(chat(url, "carol", question(f"alone{r}"), 8)["first"])
            elif condition == "long":
                thread, _ = in_thread(chat, url, "alice", words(f"long{r}", 3800), 8)
                time.sleep(1.0)
                beside_long.append(chat(url, "carol", question(f"long{r}"), 8)["first"])
                thread.join()
            else:
                sent = time.monotonic()
                thread, alice = in_thread(chat, url, "alice", words(f"answer{r}", 6000), 600,
                                          long=True)
                while thread.is_alive() and not _decoding(url):  # her answer has begun
                    time.sleep(0.2)
                seen = time.monotonic() - sent
                before = counters(url)
                doc, bob = in_thread(chat, url, "bob", words(f"doc{r}", 2100), 8)
                time.sleep(0.5)
                behind.append(chat(url, "carol", question(f"behind{r}"), 8)["first"])
                doc.join()
                thread.join()
                after = counters(url)
                print(f"  behind: alice's answer seen at {seen:.1f} s, her first token at "
                      f"{alice['first']:.1f} s; bob's first token after {bob['first']:.1f} s; "
                      f"{ {k: after[k] - before.get(k, 0) for k in after} }", flush=True)
        print(f"chat round {r + 1}: alone {alone[-1]:.2f} s, beside a new long prompt "
              f"{beside_long[-1]:.2f} s, behind a document that cannot fit {behind[-1]:.2f} s",
              flush=True)
    ratio = lambda xs: [x / a for x, a in zip(xs, alone)]  # noqa: E731
    print(f"chat: carol's first token alone {spread(alone)} s; beside a new long prompt "
          f"{spread(beside_long)} s ({spread(ratio(beside_long))}x); behind a document that "
          f"cannot fit yet {spread(behind)} s ({spread(ratio(behind))}x)", flush=True)


def _decoding(url: str) -> bool:
    """Some slot generates tokens (its prompt is done): /slots' next_token counts them."""
    return any(s["is_processing"] and s["n_decoded"] > 0 for s in _slots(url))


def _slots(url: str) -> list[dict]:
    return CLIENT.get(url + "/slots", headers=auth("admin")).json()


def case_flood(url: str, rounds: int) -> None:
    alone, beside, costs = [], [], []
    for r in range(rounds):
        for condition in in_turn(r, "alone", "flood"):
            doc = words(f"flood{r}{condition}", 6000)
            if condition == "alone":
                alone.append(chat(url, "alice", doc, 600, long=True)["end"])
                continue
            stop = threading.Event()

            def colleague(name: str) -> None:
                i = 0
                while not stop.is_set():
                    chat(url, name, f"Give me one word for the number {i}.", 16)
                    i += 1
                    time.sleep(0.3)
            before = counters(url)
            chatters = [threading.Thread(target=colleague, args=(n,), daemon=True)
                        for n in ("bob", "carol")]
            for t in chatters:
                t.start()
            beside.append(chat(url, "alice", doc, 600, long=True)["end"])
            stop.set()
            for t in chatters:
                t.join()
            after = counters(url)
            costs.append({k: after.get(k, 0) - before.get(k, 0) for k in after})
        print(f"flood round {r + 1}: alice's document alone {alone[-1]:.1f} s, beside the chats "
              f"{beside[-1]:.1f} s; {costs[-1]}", flush=True)
    print(f"flood: alice's 6,300-token document (600 out) alone {spread(alone)} s, beside two "
          f"colleagues chatting {spread(beside)} s "
          f"({spread([b / a for b, a in zip(beside, alone)])}x); saves "
          f"{[int(c.get('prompt_cache_saves', 0)) for c in costs]}, restores "
          f"{[int(c.get('prompt_cache_hits', 0)) for c in costs]}, preemptions "
          f"{[int(c.get('num_preemptions', 0)) for c in costs]} per round", flush=True)


def case_four(url: str, rounds: int) -> None:
    answers, starts = [], []
    for r in range(rounds):
        docs = [in_thread(chat, url, "alice", words(f"four{r}{i}", 670), 300, long=True)
                for i in range(4)]
        while not all(result.get("first") for _, result in docs) and _running_prompts(url):
            time.sleep(0.2)
        bob = chat(url, "bob", words(f"bob{r}", 670), 8)
        for thread, _ in docs:
            thread.join()
        answers.append(statistics.median(res["end"] - res["first"] for _, res in docs))
        starts.append(bob["first"])
        print(f"four round {r + 1}: bob's first token {starts[-1]:.1f} s, one of alice's answers "
              f"{answers[-1]:.1f} s", flush=True)
    print(f"four: bob's new document starts after {spread(starts)} s while alice runs four; "
          f"one of her answers takes {spread(answers)} s "
          f"({spread([s / a for s, a in zip(starts, answers)])} of an answer)", flush=True)


def _running_prompts(url: str) -> bool:
    """Any slot still computes its prompt (none generates yet)."""
    return any(s["is_processing"] and s["n_decoded"] == 0 for s in _slots(url))


def case_title(url: str, rounds: int) -> None:
    alone, beside, titles = [], [], []
    for r in range(rounds):
        for condition in in_turn(r, "alone", "title"):
            message = words(f"title{r}{condition}", 2000)
            first = chat(url, "carol", message, 24)
            follow = [{"role": "user", "content": message},
                      {"role": "assistant", "content": first["text"]},
                      {"role": "user", "content": "Say it again in five words."}]
            if condition == "alone":
                alone.append(chat(url, "carol", follow, 8)["first"])
                continue
            task = TITLE.replace("{user}", message).replace("{assistant}", first["text"])
            thread, title = in_thread(lambda: CLIENT.post(
                url + "/v1/chat/completions", headers=auth("carol"), json={
                    "messages": [{"role": "user", "content": task}], "max_tokens": 1000,
                    "temperature": 1.0}).json())
            time.sleep(0.05)
            beside.append(chat(url, "carol", follow, 8)["first"])
            thread.join()
            titles.append(title.get("usage", {}).get("completion_tokens"))
        print(f"title round {r + 1}: carol's follow-up alone {alone[-1]:.2f} s, beside its "
              f"title {beside[-1]:.2f} s; the title {titles[-1]} tokens", flush=True)
    print(f"title: carol's follow-up first token alone {spread(alone)} s, beside its own title "
          f"{spread(beside)} s ({spread([b / a for b, a in zip(beside, alone)])}x); titles "
          f"{titles} tokens (max_tokens 1000 asked)", flush=True)


def case_farm(url: str, rounds: int) -> None:
    firsts: dict[str, list[float]] = {"alone": [], "1": [], "3": []}
    for r in range(rounds):
        for condition in in_turn(r, *firsts):
            stop, chats = threading.Event(), []

            def bob(connection: int) -> None:
                i = 0
                while not stop.is_set():
                    chat(url, "bob", f"Say one word. ({connection}.{i})", 1)
                    i, chats[0] = i + 1, chats[0] + 1
            chats.append(0)
            senders = [threading.Thread(target=bob, args=(c,), daemon=True)
                       for c in range(0 if condition == "alone" else int(condition))]
            for t in senders:
                t.start()
            firsts[condition].append(chat(url, "alice", words(f"farm{r}{condition}", 2000), 8)
                                     ["first"])
            stop.set()
            for t in senders:
                t.join()
            print(f"farm round {r + 1}, {condition}: alice's first token "
                  f"{firsts[condition][-1]:.1f} s; bob's chats {chats[0]}", flush=True)
    alone = firsts.pop("alone")
    print(f"farm: alice's new 2,500-token prompt, first token alone {spread(alone)} s; "
          + "; ".join(f"beside bob's chats on {n} connection(s) {spread(xs)} s "
                      f"({spread([x / a for x, a in zip(xs, alone)])}x)"
                      for n, xs in firsts.items()), flush=True)


CASES = {"chat": case_chat, "flood": case_flood, "four": case_four, "title": case_title,
         "farm": case_farm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=tuple(CASES))
    parser.add_argument("--server-args", default="", help="more `localserve up` arguments")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        keys = key_file(Path(folder), *(f"{n}:{k}" + (":admin" if n == "admin" else "")
                                        for n, k in KEYS.items()))
        with running("-t", "2", "--api-key-file", str(keys), *args.server_args.split(),
                     log_name="bench-pool") as srv:
            for name, case in CASES.items():
                if args.only in (None, name):
                    case(srv.url, args.rounds)


if __name__ == "__main__":
    main()
