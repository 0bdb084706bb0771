"""JSON-schema patterns with regular-expression escapes (api/schema_patterns.py): rewritten into
classes the schema-to-grammar converter copies as they are, checked against Python's `re` on
matching and non-matching strings, and refused by name where no grammar can follow them."""

import re

import pytest

from localserve.api.schema_patterns import PatternError, plain_pattern, plain_patterns

COMMON = {  # pattern: (strings it matches, strings it does not)
    r"^[\w.+-]+@[\w-]+\.[a-z]{2,}$": (["ann.lee+x@office-1.lan"], ["ann@office", "a b@c.de"]),
    r"^\d{4}-\d{2}-\d{2}$": (["2026-12-02"], ["2026-1-02", "20261202"]),
    r"^\-?\d+\.\d{2}$": (["-12.50", "3.00"], ["3.5", "+3.50"]),
    r"^\+?\d[\d\-]{6,}$": (["+41-44-123", "0441234567"], ["12-34", "abc1234567"]),
    r"^[A-Z]{2}\d{2}\s\d{4}$": (["CH93 0076"], ["ch93 0076", "CH930076"]),
    r"^\W\D\S$": (["!a-"], ["aa-", "!1-", "!a "]),
}


@pytest.mark.parametrize("pattern", COMMON)
def test_common_patterns_keep_their_meaning(pattern):
    plain = plain_pattern(pattern)
    assert "\\d" not in plain and "\\." not in plain and "\\w" not in plain
    good, bad = COMMON[pattern]
    for text in good:
        assert re.fullmatch(plain, text), (plain, text)
    for text in bad:
        assert not re.fullmatch(plain, text), (plain, text)


def test_every_pattern_in_a_schema_is_rewritten_and_nothing_else():
    schema = {"type": "object", "properties": {
        "day": {"type": "string", "pattern": r"^\d{2}$", "description": r"two \d"},
        "list": {"type": "array", "items": [{"pattern": r"\."}]}}}
    out = plain_patterns(schema)
    assert out["properties"]["day"] == {"type": "string", "pattern": "^[0-9]{2}$",
                                        "description": r"two \d"}
    assert out["properties"]["list"]["items"][0]["pattern"] == r"[\x2E]"


@pytest.mark.parametrize("pattern", [r"(a)\1", r"\bword\b", r"\p{L}+", r"[\D]", r"a\nb"])
def test_escapes_no_grammar_can_follow_are_refused_by_name(pattern):
    with pytest.raises(PatternError, match="pattern"):
        plain_pattern(pattern)
