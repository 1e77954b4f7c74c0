"""Whether a grammar's leaf can match anything: a Lark terminal's regex, or a JSON schema's
scalar (a string, a number, an enum) under its bounds. A leaf that matches nothing is no
way to end a grammar (grammar_ends.py): `start: "a" start | E` with `E: /[^\\s\\S]/` never
ends, nor does a schema whose only way out is an integer between 5 and 3.

Each answer is one of three: `SOME` (a match exists: the length of a shortest one, as
found), `NONE` (nothing matches, proven), `UNREAD` (the check cannot tell: a regex in a
syntax Python's `re` does not read as llguidance does, a lookaround, a `pattern` or
`format` beside length bounds). Nothing here is llguidance's: what it cannot prove is
unread, so a grammar that ends only through such a leaf is bounded, never refused.

Regexes are read by Python's own parser (`re._parser`, linear in the pattern); the schema
checks are arithmetic on the bounds."""

from __future__ import annotations

import bisect
import math
import re
import warnings
from fractions import Fraction
from functools import lru_cache
from re import _constants as sre
from re import _parser
from typing import Any, Literal

Unmatched = Literal["none", "unread"]
# A leaf's verdict: a shortest match's length (it matches), or why no length is known.
Matches = int | Unmatched
NONE: Unmatched = "none"
UNREAD: Unmatched = "unread"

_GAPS_TRIED = 64  # characters just past a negated class's runs tried, at most
# Characters tried against a negated class: one it does not hold is a match of it.
_CANDIDATES = "a0 _!-\n\t.Zé中\U0001f600\x00"
# The categories a negated class is read with, as `re` spells them.
_CATEGORY_RE = {
    sre.CATEGORY_DIGIT: r"\d",
    sre.CATEGORY_NOT_DIGIT: r"\D",
    sre.CATEGORY_SPACE: r"\s",
    sre.CATEGORY_NOT_SPACE: r"\S",
    sre.CATEGORY_WORD: r"\w",
    sre.CATEGORY_NOT_WORD: r"\W",
}
# Pairs of categories that together hold every character: a class negating both is empty.
_COMPLEMENTS = (
    {sre.CATEGORY_DIGIT, sre.CATEGORY_NOT_DIGIT},
    {sre.CATEGORY_SPACE, sre.CATEGORY_NOT_SPACE},
    {sre.CATEGORY_WORD, sre.CATEGORY_NOT_WORD},
)
_EDGES = {sre.AT_BEGINNING, sre.AT_BEGINNING_STRING, sre.AT_END, sre.AT_END_STRING}
_REPEATS = {sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT}
_MAX_CHAR = 0x10FFFF
_PROPERTY = re.compile(r"\\[pP](?:\{[^}]*\}|[A-Za-z])")
_OPENING = re.compile(r"\[\^?\]?")  # a class's opening: `[^]` holds `]`


@lru_cache(maxsize=4096)
def regex_matches(pattern: str, anchored_edges: bool = False) -> Matches:
    """Whether a regex matches some text (`anchored_edges`: a `^` that begins it and a `$`
    that ends it read as the edges of the text, as a JSON schema's `pattern` has them)."""
    try:
        with warnings.catch_warnings():
            # A nested set or a set operation (`[[:alpha:]]`, `&&`): Rust's regexes, which
            # llguidance's are, read them otherwise than Python's.
            warnings.simplefilter("error", FutureWarning)
            parsed = _parser.parse(_properties_read(pattern))
    except (re.error, FutureWarning, RecursionError, OverflowError, ValueError):
        return UNREAD
    items = list(parsed)
    if anchored_edges:
        while items and items[0] == (sre.AT, sre.AT_BEGINNING):
            items.pop(0)
        while items and items[-1][0] == sre.AT and items[-1][1] in _EDGES:
            items.pop()
    ignore_case = bool(parsed.state.flags & re.IGNORECASE)
    try:
        return _sequence(items, ignore_case)
    except RecursionError:
        return UNREAD


def _properties_read(pattern: str) -> str:
    """Rust's Unicode properties (`\\p{L}`, `\\PL`), which Python's `re` does not read:
    outside a class, each one character of some kind, read as `.` (inside one, where
    what it leaves out would count, they stay unread)."""
    if "\\p" not in pattern and "\\P" not in pattern:
        return pattern
    out, at, in_class = [], 0, False
    while at < len(pattern):
        char = pattern[at]
        if char == "\\":
            named = _PROPERTY.match(pattern, at)
            out.append("." if named and not in_class else pattern[at : at + 2])
            at = named.end() if named and not in_class else at + 2
            continue
        if char == "[" and not in_class:
            opening = _OPENING.match(pattern, at)
            assert opening is not None  # `[` at least
            out.append(opening.group())
            at, in_class = opening.end(), True
            continue
        in_class = in_class and char != "]"
        out.append(char)
        at += 1
    return "".join(out)


def _sequence(items: Any, ignore_case: bool) -> Matches:
    """All of `items` in turn: nothing if one matches nothing, whatever the others."""
    total: Matches = 0
    for op, arg in items:
        one = _item(op, arg, ignore_case)
        if one == NONE:
            return NONE
        if one == UNREAD or total == UNREAD:
            total = UNREAD
        else:
            assert isinstance(total, int) and isinstance(one, int)
            total += one
    return total


def _item(op: Any, arg: Any, ignore_case: bool) -> Matches:
    if op in (sre.LITERAL, sre.NOT_LITERAL, sre.ANY):
        return 1
    if op == sre.IN:
        return _class(arg, ignore_case)
    if op == sre.SUBPATTERN:
        return _sequence(arg[-1], ignore_case)
    if op == sre.ATOMIC_GROUP:
        return _sequence(arg, ignore_case)
    if op == sre.BRANCH:
        ways = [_sequence(way, ignore_case) for way in arg[1]]
        found = [w for w in ways if isinstance(w, int)]
        if found:
            return min(found)
        return NONE if all(w == NONE for w in ways) else UNREAD
    if op in _REPEATS:
        least, _, body = arg
        if least == 0:
            return 0
        one = _sequence(body, ignore_case)
        return one * least if isinstance(one, int) else one
    return UNREAD  # an anchor inside, a lookaround, a backreference


def _class(items: list[tuple[Any, Any]], ignore_case: bool) -> Matches:
    """A character class: it holds a character unless it is negated and covers them all."""
    if not items or items[0][0] != sre.NEGATE:
        return 1 if items else NONE
    rest = items[1:]
    categories = [_CATEGORY_RE.get(arg) for op, arg in rest if op == sre.CATEGORY]
    if None in categories:
        return UNREAD  # a category this check does not know
    if any(pair <= {arg for op, arg in rest if op == sre.CATEGORY} for pair in _COMPLEMENTS):
        return NONE
    runs = _merged(sorted((arg, arg) if op == sre.LITERAL else arg for op, arg in rest
        if op != sre.CATEGORY))  # fmt: skip
    if not categories and runs == [(0, _MAX_CHAR)]:
        return NONE
    # Characters next to the runs are outside them: with a few common ones, tried.
    gaps = [chr(hi + 1) for _, hi in runs[:_GAPS_TRIED] if hi < _MAX_CHAR]
    gaps += [chr(0)] if not runs or runs[0][0] > 0 else []
    for candidate in [*_CANDIDATES, *gaps]:
        cases = {candidate, candidate.lower(), candidate.upper()} if ignore_case else {candidate}
        if not any(_holds(runs, categories, c) for c in cases):
            return 1
    return UNREAD


def _merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for lo, hi in intervals:
        if runs and lo <= runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], max(runs[-1][1], hi))
        else:
            runs.append((lo, hi))
    return runs


def _holds(runs: list[tuple[int, int]], categories: list[Any], char: str) -> bool:
    code = ord(char)
    at = bisect.bisect_right(runs, (code, _MAX_CHAR)) - 1
    if at >= 0 and runs[at][0] <= code <= runs[at][1]:
        return True
    return any(re.fullmatch(pattern, char) for pattern in categories)


# JSON schema's formats llguidance compiles (another is refused there), each with a text
# it accepts (tests/unit/test_grammar_ends.py holds this with llguidance): a `format`
# beside length bounds matches where its text fits them.
FORMAT_TEXTS = {
    "date-time": "2020-01-01T00:00:00Z",
    "time": "00:00:00Z",
    "date": "2020-01-01",
    "duration": "P1D",
    "email": "a@b.co",
    "hostname": "a",
    "ipv4": "1.1.1.1",
    "ipv6": "::1",
    "uuid": "00000000-0000-0000-0000-000000000000",
    "uri": "http://a.b",
}


def scalar_matches(node: dict[str, Any], kind: str) -> Matches:
    """Whether a schema's scalar of type `kind` (string, number, integer, boolean, null)
    has a value under the schema's bounds."""
    if kind in ("boolean", "null"):
        return 1
    if kind in ("number", "integer"):
        return 1 if _number_exists(node, kind == "integer") else NONE
    if kind != "string":
        return UNREAD  # llguidance's to refuse
    least, most = _count(node.get("minLength"), 0) or 0, _count(node.get("maxLength"), None)
    if most is not None and least > most:
        return NONE
    texts: list[Matches] = []
    if "pattern" in node:
        pattern = node["pattern"]
        texts.append(regex_matches(pattern, True) if isinstance(pattern, str) else UNREAD)
    if "format" in node:
        text = FORMAT_TEXTS.get(node["format"]) if isinstance(node["format"], str) else None
        texts.append(UNREAD if text is None else len(text))
    if NONE in texts:
        return NONE
    if not texts:
        return least
    if len(texts) > 1 or UNREAD in texts:
        return UNREAD  # a pattern and a format: whether both hold one text is not read
    (length,) = texts
    assert isinstance(length, int)
    # A shortest match is the one length known: longer ones may or may not exist.
    return length if least <= length and (most is None or length <= most) else UNREAD


def _count(value: object, default: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _number(value: object) -> Fraction | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return Fraction(str(value)) if isinstance(value, float) else Fraction(value)


def _number_exists(node: dict[str, Any], integer: bool) -> bool:
    """Whether a number (an integer) lies within the bounds and is a `multipleOf`'s."""
    low, high = (
        _bound(node, "minimum", "exclusiveMinimum", max),
        _bound(node, "maximum", "exclusiveMaximum", min),
    )
    step = _number(node.get("multipleOf"))
    if step is not None and step <= 0:
        step = None  # not a step: llguidance's to refuse
    if integer:
        step = Fraction(step.numerator) if step is not None else Fraction(1)
    if low is None or high is None:
        return True
    (lo, lo_strict), (hi, hi_strict) = low, high
    if step is None:
        return lo < hi or (lo == hi and not (lo_strict or hi_strict))
    first = math.ceil(lo / step) * step  # the least multiple at or above the floor
    if lo_strict and first == lo:
        first += step
    return first < hi or (first == hi and not hi_strict)


def _bound(node: dict[str, Any], inclusive: str, exclusive: str, tighter: Any) -> Any:
    """(the bound, whether it is exclusive): the tighter of the two keywords; None: none."""
    bounds = [(v, strict) for word, strict in ((inclusive, False), (exclusive, True))
        if (v := _number(node.get(word))) is not None]  # fmt: skip
    if not bounds:
        return None
    best = tighter(v for v, _ in bounds)
    return best, any(strict for v, strict in bounds if v == best)


def enum_matches(node: dict[str, Any], types: list[Any] | None) -> Matches:
    """Whether a `const` or an `enum` holds a value of the schema's types (None: any)
    within its bounds; of those types but out of bounds, unread (whether llguidance
    holds such a value to them is its own)."""
    values = node.get("enum")
    if not isinstance(values, list):
        values = None if "enum" in node else [node["const"]]
    elif "const" in node:
        values = [v for v in values if v == node["const"]]
    if values is None:
        return UNREAD
    typed = [v for v in values if types is None or any(_is_type(v, t) for t in types)]
    if not typed:
        return NONE
    if any(_fits(node, v) for v in typed):
        return 1
    return UNREAD


def _is_type(value: object, kind: object) -> bool:
    if kind == "integer":
        number = _number(value)
        return number is not None and number.denominator == 1
    return kind == {
        bool: "boolean", int: "number", float: "number", str: "string", type(None): "null",
        list: "array", dict: "object",
    }.get(type(value))  # fmt: skip


def _fits(node: dict[str, Any], value: object) -> bool:
    if isinstance(value, str):
        least, most = _count(node.get("minLength"), 0) or 0, _count(node.get("maxLength"), None)
        return least <= len(value) and (most is None or len(value) <= most)
    number = _number(value)
    if number is None:
        return True  # no bound of this check's applies
    low = _bound(node, "minimum", "exclusiveMinimum", max)
    high = _bound(node, "maximum", "exclusiveMaximum", min)
    above = low is None or number > low[0] or (number == low[0] and not low[1])
    below = high is None or number < high[0] or (number == high[0] and not high[1])
    return above and below
