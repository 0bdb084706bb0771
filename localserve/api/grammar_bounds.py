"""Bounds on grammars and schemas, checked on the raw text before llama.cpp or the schema
converter sees it: both do work proportional to what a few bytes can ask for, and llama.cpp's
GBNF parser recurses once per nested group (20,000 nested parentheses, 39 KiB, overflow its
stack and kill the process).

- GBNF: at most MAX_GBNF_NESTING nested groups, MAX_GBNF_RULES rules, `{m,n}` repetitions
  adding up to at most MAX_REPEAT (llama.cpp expands each into copies), and no rule that can
  reach itself without consuming a character (llama.cpp hangs on some of those).
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
    check_left_recursion(text)


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


# ---- left recursion through empty-matching prefixes -------------------------------------
# llama.cpp refuses plain left recursion (`a ::= a "x"`) but not all of it hidden behind
# elements that can match nothing: `root ::= ("a" | [0-9]{0,3})+ (root+)*` spins forever in
# llama_sampler_init_grammar, a worker thread and a core lost per request. Such grammars are
# found here first: each rule's body is parsed, which rules can match the empty string is
# worked out, and a rule that can reach itself without consuming a character is refused.

_RULE_START = re.compile(r"^[ \t]*([A-Za-z0-9_-]+)[ \t]*::=", re.MULTILINE)
_NAME = re.compile(r"[A-Za-z0-9_-]+")


def check_left_recursion(text: str) -> None:
    rules = _parse_rules(text)
    nullable = _nullable_rules(rules)
    edges = {name: set().union(*(_left_refs(seq, nullable) for seq in alts))
             for name, alts in rules.items()}
    cycle = _find_cycle(edges)
    if cycle:
        raise BoundError(f"rule '{cycle}' can reach itself without consuming a character (left "
                         f"recursion, possibly through elements that match nothing)")


def _parse_rules(text: str) -> dict[str, list]:
    """{rule: alternatives}; an alternative is a list of (element, may_repeat_zero) where an
    element is ("lit", can_be_empty) | ("ref", name) | ("group", alternatives)."""
    text = re.sub(r"#[^\n]*", "", _blank_literals(text))
    starts = list(_RULE_START.finditer(text))
    rules: dict[str, list] = {}
    for i, m in enumerate(starts):
        body = text[m.end():starts[i + 1].start() if i + 1 < len(starts) else len(text)]
        rules[m[1]] = _Parser(body).alternatives()
    return rules


def _blank_literals(text: str) -> str:
    """String literals and character classes replaced by placeholders (their contents may hold
    any character, '#', '::=' or parentheses included): "" stays "" (it matches nothing)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"[":
            end = _skip_literal(text, i, '"' if c == '"' else "]")
            out.append('""' if text[i:end] == '""' else ("\"x\"" if c == '"' else "[x]"))
            i = end
        else:
            out.append(c)
            i += 1
    return "".join(out)


class _Parser:
    def __init__(self, body: str):
        self.s, self.i = body, 0

    def _peek(self) -> str:
        while self.i < len(self.s) and self.s[self.i].isspace():
            self.i += 1
        return self.s[self.i] if self.i < len(self.s) else ""

    def alternatives(self) -> list:
        alts = [self._sequence()]
        while self._peek() == "|":
            self.i += 1
            alts.append(self._sequence())
        return alts

    def _sequence(self) -> list:
        seq = []
        while (c := self._peek()) and c not in "|)":
            element = self._element(c)
            if element is None:
                self.i += 1  # anything else is llama.cpp's to refuse
                continue
            seq.append((element, self._optional()))
        return seq

    def _element(self, c: str):
        if c == "(":
            self.i += 1
            alts = self.alternatives()
            if self._peek() == ")":
                self.i += 1
            return ("group", alts)
        if c == '"':
            empty = self.s.startswith('""', self.i)
            self.i += 2 if empty else 3
            return ("lit", empty)
        if c == "[":
            self.i += 3
            return ("lit", False)
        if c == ".":
            self.i += 1
            return ("lit", False)
        found = _NAME.match(self.s, self.i)
        if found:
            self.i = found.end()
            return ("ref", found[0])
        return None

    def _optional(self) -> bool:
        """Whether the element's repetition allows zero copies."""
        c = self._peek()
        if c in ("*", "?"):
            self.i += 1
            return True
        if c == "+":
            self.i += 1
            return False
        found = _REPEAT.match(self.s, self.i) if c == "{" else None
        if found:
            self.i = found.end()
            return int(found[1]) == 0
        return False


def _nullable_rules(rules: dict) -> set[str]:
    nullable: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, alts in rules.items():
            if name not in nullable and any(_seq_nullable(seq, nullable) for seq in alts):
                nullable.add(name)
                changed = True
    return nullable


def _seq_nullable(seq: list, nullable: set[str]) -> bool:
    return all(optional or _element_nullable(element, nullable) for element, optional in seq)


def _element_nullable(element, nullable: set[str]) -> bool:
    kind, value = element
    if kind == "lit":
        return value
    if kind == "ref":
        return value in nullable
    return any(_seq_nullable(seq, nullable) for seq in value)


def _left_refs(seq: list, nullable: set[str]) -> set[str]:
    """Rules that may start where `seq` starts: up to its first element that cannot be empty."""
    found: set[str] = set()
    for element, optional in seq:
        kind, value = element
        if kind == "ref":
            found.add(value)
        elif kind == "group":
            found |= set().union(*(_left_refs(inner, nullable) for inner in value))
        if not (optional or _element_nullable(element, nullable)):
            break
    return found


def _find_cycle(edges: dict[str, set[str]]) -> str | None:
    """A rule on a cycle of `edges`, found without recursion; None if there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in edges:
        if start in state:
            continue
        stack = [(start, iter(edges.get(start, ())))]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
            elif state.get(child) == 1:
                return child
            elif child not in state and child in edges:
                state[child] = 1
                stack.append((child, iter(edges[child])))
    return None
