"""Texts to copy, of several kinds and none of them this repository's: what a drafter tuned on
one kind of text is measured on (a drafter that led on localserve's own sources ran 0.90x
llama-server's ngram-mod on code it had never seen).

  python    the Python standard library's sources (tests left out)
  c         CPython's C headers (where the Python installation ships them)
  prose     the Python documentation's prose (pydoc_data.topics)
  json      records with names, numbers and dates, made up from the seed
  csv       a table of the same kind of records
  markdown  a Markdown table with aligned columns

Each round's seed picks different texts; every kind gets the same number of them.
"""

from __future__ import annotations

import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

KINDS = ("python", "c", "prose", "json", "csv", "markdown")
INSTRUCTION = "Rewrite this exactly, adding one line at the top that says what it is:\n"
NAMES = ("Ada Okafor", "Bruno Lind", "Chen Wei", "Dana Novak", "Emil Haddad", "Farah Qureshi",
         "Goran Petrov", "Hana Sato", "Ines Duarte", "Jonas Berg", "Kofi Mensah", "Lena Vogel")
CITIES = ("Lisbon", "Oslo", "Nairobi", "Osaka", "Quito", "Tallinn", "Perth", "Lyon")
ITEMS = ("stapler", "toner", "desk lamp", "monitor arm", "headset", "whiteboard", "chair mat")


@dataclass(frozen=True)
class CopyText:
    kind: str
    text: str


def copy_corpus(seed: int, per_kind: int = 2, lines: int = 24,
                kinds: tuple[str, ...] = KINDS) -> list[CopyText]:
    """per_kind texts of each kind (a kind this machine cannot supply is left out), about
    `lines` lines each, interleaved kind by kind so that a cut-off run still mixes kinds."""
    rng = random.Random(seed)
    found = {kind: _texts(kind, rng, per_kind, lines) for kind in kinds}
    return [text for group in zip(*[found[k] for k in kinds if found[k]]) for text in group]


def _texts(kind: str, rng: random.Random, n: int, lines: int) -> list[CopyText]:
    if kind in ("python", "c", "prose"):
        pool = _source_lines(kind)
        if not pool:
            return []
        return [CopyText(kind, _excerpt(rng.choice(pool), rng, lines)) for _ in range(n)]
    make = {"json": _json_records, "csv": _csv_rows, "markdown": _markdown_table}[kind]
    return [CopyText(kind, make(rng, lines)) for _ in range(n)]


def _source_lines(kind: str) -> list[list[str]]:
    """Texts of a kind outside this repository, each as lines long enough to excerpt."""
    if kind == "prose":
        from pydoc_data.topics import topics
        texts = list(topics.values())
    else:
        root = Path(sysconfig.get_paths()["stdlib" if kind == "python" else "include"])
        pattern = "*.py" if kind == "python" else "**/*.h"
        texts = [p.read_text(errors="replace") for p in sorted(root.glob(pattern))
                 if "test" not in p.name]
    return [t.splitlines() for t in texts if len(t.splitlines()) > 60]


def _excerpt(source: list[str], rng: random.Random, lines: int) -> str:
    start = rng.randrange(len(source) - lines)
    return "\n".join(source[start:start + lines])


def _record(rng: random.Random, i: int) -> dict:
    return {"id": 1000 + i, "name": rng.choice(NAMES), "city": rng.choice(CITIES),
            "item": rng.choice(ITEMS), "quantity": rng.randint(1, 40),
            "price": round(rng.uniform(2, 400), 2),
            "ordered": f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"}


def _json_records(rng: random.Random, lines: int) -> str:
    records = [_record(rng, i) for i in range(max(1, lines // 9))]
    return json.dumps(records, indent=2)


def _csv_rows(rng: random.Random, lines: int) -> str:
    rows = [_record(rng, i) for i in range(lines - 1)]
    return "\n".join([",".join(rows[0])] + [",".join(str(v) for v in r.values()) for r in rows])


def _markdown_table(rng: random.Random, lines: int) -> str:
    rows = [_record(rng, i) for i in range(lines - 2)]
    head = "| " + " | ".join(rows[0]) + " |"
    rule = "|" + "|".join("---:" if isinstance(v, (int, float)) else "---"
                          for v in rows[0].values()) + "|"
    return "\n".join([head, rule] + ["| " + " | ".join(str(v) for v in r.values()) + " |"
                                     for r in rows])
