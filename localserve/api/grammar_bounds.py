"""Bounds on grammars and schemas, checked on the raw text before llama.cpp or the schema
converter sees it: both do work proportional to what a few bytes can ask for, and llama.cpp's
GBNF parser recurses once per nested group (20,000 nested parentheses, 39 KiB, overflow its
stack and kill the process).

- GBNF: at most MAX_GBNF_NESTING nested groups, MAX_GBNF_RULES rules, and `{m,n}`
  repetitions adding up to at most MAX_REPEAT (llama.cpp expands each into copies).
- JSON schema: length, item and property counts at most MAX_REPEAT (the converter
  writes one grammar element per allowed repetition), and `{m,n}` in patterns likewise.
"""

from __future__ import annotations

import re

MAX_GBNF_NESTING = 64  # llama.cpp survived 8,000 here; a real grammar nests a handful deep
MAX_GBNF_RULES = 2000  # schema grammars of 64 rich tools stay in the low hundreds
MAX_REPEAT = 1000  # maxLength, maxItems, {m,n}, ...: each repetition costs grammar text
COUNT_KEYWORDS = ("maxLength", "minLength", "maxItems", "minItems", "maxProperties",
                  "minProperties", "maxContains", "minContains")
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


class BoundError(ValueError):
    """What a grammar or schema asks for is beyond a bound; the message names it."""


def check_gbnf(text: str) -> None:
    """Refuse GBNF nested deeper or with more rules than the bounds, reading it once without
    recursion (string literals and character classes are skipped, as the parser skips them)."""
    depth = deepest = rules = repeats = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"[":
            i = _skip_literal(text, i, '"' if c == '"' else "]")
            continue
        if c == "#":
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        if c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth = max(0, depth - 1)
        elif text.startswith("::=", i):
            rules += 1
        elif c == "{" and (found := _REPEAT.match(text, i)):
            repeats += max(int(found[1]), int(found[2] or 0))
        i += 1
    if deepest > MAX_GBNF_NESTING:
        raise BoundError(f"the grammar nests groups {deepest} deep; the limit is {MAX_GBNF_NESTING}")
    if rules > MAX_GBNF_RULES:
        raise BoundError(f"the grammar has {rules} rules; the limit is {MAX_GBNF_RULES}")
    if repeats > MAX_REPEAT:
        raise BoundError(f"the grammar's {{m,n}} repetitions add up to {repeats}; the limit is "
                         f"{MAX_REPEAT}")


def _skip_literal(text: str, start: int, close: str) -> int:
    """Index just past the literal opened at `start` (backslash escapes honoured)."""
    i = start + 1
    while i < len(text) and text[i] != close:
        i += 2 if text[i] == "\\" else 1
    return i + 1


def check_schema(schema) -> None:
    """Refuse a schema whose counts (lengths, items, pattern repetitions) exceed the bound.
    Walks without recursion: the caller has bounded the depth, but not the breadth."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key in COUNT_KEYWORDS and isinstance(value, (int, float)) and value > MAX_REPEAT:
                raise BoundError(f"{key} {value} is above the limit of {MAX_REPEAT}")
            if key == "pattern" and isinstance(value, str):
                _check_pattern(value)
            if isinstance(value, (dict, list)):
                stack.append(value)


def _check_pattern(pattern: str) -> None:
    total = sum(max(int(low), int(high or 0)) for low, high in _REPEAT.findall(pattern))
    if total > MAX_REPEAT:
        raise BoundError(f"pattern repetitions {{m,n}} add up to {total}; the limit is {MAX_REPEAT}")
