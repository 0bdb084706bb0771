"""JSON-schema `pattern`s rewritten for llama-cpp-python's schema-to-grammar converter, which
reads regular-expression escapes as literal text: `\\d{3}` became the characters "\\d\\d\\d"
and `\\.` the two characters "\\.", so every e-mail, date or decimal pattern was refused as an
invalid grammar (or, worse, constrained to nonsense). Before converting, each escape becomes
a character class the converter copies as it is: `\\d` -> `[0-9]`, `\\w` -> `[a-zA-Z0-9_]`,
`\\s` -> a space, `\\D`/`\\W`/`\\S` their complements, an escaped character -> `[\\xHH]`.
Escapes a grammar cannot express (backreferences, word boundaries, Unicode classes) are
refused by name rather than dropped."""

from __future__ import annotations

# \s is a space: a raw tab or newline is not valid inside a JSON string, so no pattern may
# match one there (and \n, \t... are refused)
CLASSES = {"d": "0-9", "w": "a-zA-Z0-9_", "s": " "}


class PatternError(ValueError):
    """A pattern escape no grammar here can express."""


def plain_patterns(schema):
    """The schema with every `pattern` string rewritten (see the module doc); the rest as is."""
    if isinstance(schema, dict):
        return {key: plain_pattern(value) if key == "pattern" and isinstance(value, str)
                else plain_patterns(value) for key, value in schema.items()}
    if isinstance(schema, list):
        return [plain_patterns(item) for item in schema]
    return schema


def plain_pattern(pattern: str) -> str:
    out, in_class, i = [], False, 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            out.append(_escape(pattern[i + 1], in_class, pattern))
            i += 2
            continue
        if char == "[" and not in_class:
            in_class = True
        elif char == "]" and in_class and out and out[-1] not in ("[", "[^"):
            in_class = False
        out.append(char)
        i += 1
    return "".join(out)


def _escape(char: str, in_class: bool, pattern: str) -> str:
    if char in CLASSES:
        return CLASSES[char] if in_class else f"[{CLASSES[char]}]"
    if char.lower() in CLASSES:
        if in_class:
            raise PatternError(f"pattern {pattern!r}: \\{char} inside [...] is not supported; "
                               f"spell the class out")
        return f"[^{CLASSES[char.lower()]}]"
    if char.isalnum():
        raise PatternError(f"pattern {pattern!r}: \\{char} cannot be turned into a grammar "
                           f"(no backreferences, word boundaries or Unicode classes)")
    hex_code = f"\\x{ord(char):02X}" if ord(char) < 256 else f"\\u{ord(char):04X}"
    return hex_code if in_class else f"[{hex_code}]"
