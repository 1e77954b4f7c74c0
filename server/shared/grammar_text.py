"""A Lark or GBNF grammar's text before llguidance compiles it: the bounds on its size,
checked before any of it is read (`grammar_bounds`), and GBNF's conversion to Lark
(`lark_of_gbnf`, llguidance's own in time linear in the grammar). Both hold the GIL and
the one grammar thread while they run (server/shared/constraint.py), so neither may take
time a grammar's size does not bound."""

from __future__ import annotations

import re
import time
from typing import Any

from llguidance import gbnf_to_lark

# Bounds on a grammar's text, checked before any of it is read. llguidance's compile
# recurses along a grammar's chains of rules and the nesting in each, on the stack of the
# thread compiling it: a chain of a few thousand rules (fewer, nested) overflows that
# stack and the process dies (a signal, not an error). A grammar's weight,
# its rules each counted with the deepest nesting in it, bounds any chain in it. Nesting
# deeper than llguidance's own limit is refused as it would be, before Python's recursion
# in Lark and the GBNF conversion reads it.
MAX_WEIGHT = 2048
MAX_DEPTH = 32
# A line that goes on the statement before it (Lark allows a new line only before `|`),
# a comment, or the inside of an llguidance block (`%json {`, `%lark {`); or none.
GOES_ON = frozenset(" \t\r\n|/#)]}")


class CheckTimeout(Exception):
    """The check ran past its deadline."""


def grammar_bounds(kind: str, text: str) -> str | None:
    """Why a Lark or GBNF grammar's text is over a bound (None: within them). One pass
    over the text, in time linear in it."""
    if kind not in ("lark", "gbnf"):
        return None
    weight, depth = _weight(text, gbnf=kind == "gbnf")
    if depth > MAX_DEPTH:
        return f"the grammar nests {depth} levels deep, over the limit of {MAX_DEPTH}"
    if weight > MAX_WEIGHT:
        return (
            f"the grammar's rules weigh {weight} (a rule 1, and 1 more for each level of "
            f"nesting in it), over the limit of {MAX_WEIGHT}"
        )
    return None


def _weight(text: str, gbnf: bool) -> tuple[int, int]:
    """A grammar's weight (each rule 1 and its deepest nesting) and its deepest nesting:
    of `(` (and Lark's `[`) outside literals, character classes, regular expressions and
    comments. A rule begins at GBNF's `::=`, or a Lark line that does not go on another."""
    closers = {'"': '"', "[": "]"} if gbnf else {'"': '"', "/": "/"}
    opens, shuts = ("(", ")") if gbnf else ("([", ")]")
    weight = depth = deepest = rule_deepest = i = 0
    n = len(text)
    while i < n:
        c = text[i]
        comment = c == "#" or (not gbnf and text.startswith("//", i))
        if (
            text.startswith("::=", i)
            if gbnf
            else (c not in GOES_ON and (i == 0 or text[i - 1] == "\n"))
        ):
            weight += 1 + rule_deepest
            rule_deepest = 0
        if c in closers and not comment:
            close, i = closers[c], i + 1
            while i < n and text[i] != close and text[i] != "\n":
                i += 2 if text[i] == "\\" else 1
        elif comment:
            i = text.find("\n", i)
            if i < 0:
                break
        elif c in opens:
            depth += 1
            rule_deepest = max(rule_deepest, depth)
            deepest = max(deepest, depth)
        elif c in shuts:
            depth = max(0, depth - 1)
        i += 1
    return weight + rule_deepest, deepest


def lark_of_gbnf(text: str, deadline: float | None = None) -> str:
    """llguidance's conversion of a GBNF grammar to Lark (`grammar_from`'s), in time linear
    in the grammar: llguidance's own finds the rules that are terminals (refer to
    terminals only) by passes over every rule until none changes, one rule a pass in a
    chain, and asks whether the text is Lark already with a regular expression that
    backtracks over every run of blank lines from each of its lines; both hold the GIL.
    A grammar it cannot read: ValueError, in llguidance's words; past `deadline` (a
    `time.perf_counter()`): `CheckTimeout`."""
    if _is_lark_syntax(text):
        return text
    try:
        rules = gbnf_to_lark.GrammarParser().parse(text)
        _mark_terminal_rules(rules)
        gbnf_to_lark.resolve(rules)  # its passes find nothing more: one pass
    except Exception as exc:  # any failure of llguidance's parser, as `grammar_from` says it
        raise ValueError(f"Failed to convert the grammar from GBNF to Lark: {exc}") from None
    if deadline is not None and time.perf_counter() > deadline:
        raise CheckTimeout
    res = "%llguidance {}\n\n"
    prev_nl = True
    for rule in sorted(rules.values(), key=lambda r: r.order):
        s = str(rule)
        if not prev_nl and "\n" in s:
            res += "\n"
        res += s + "\n"
        prev_nl = "\n" in s
        if prev_nl:
            res += "\n"
    return res


_LARK_START = re.compile(r"%llguidance\b|start\s*+:")


def _is_lark_syntax(text: str) -> bool:
    """llguidance's `is_lark_syntax` (a line, after any blank ones, that begins with
    `%llguidance` or `start:`), a line at a time."""
    at = 0
    for line in text.split("\n"):
        begins = at + len(line) - len(line.lstrip())
        if _LARK_START.match(text, begins):
            return True
        at += len(line) + 1
    return False


def _mark_terminal_rules(rules: dict[str, Any]) -> None:
    """Marks the rules llguidance's conversion makes terminals: all but `root` (which
    becomes `start`), once every rule each refers to is one. A rule is marked when the
    last of what it refers to is, so each rule is read once."""
    waiting: dict[str, set[str]] = {}
    readers: dict[str, list[str]] = {}
    for name, rule in rules.items():
        refs, todo = set(), [rule.alternatives]
        while todo:
            node = todo.pop()
            if isinstance(node, gbnf_to_lark.RuleRefNode):
                refs.add(node.name)
            todo += node.children()
        waiting[name] = refs
        for ref in refs:
            readers.setdefault(ref, []).append(name)
    ready = [name for name, refs in waiting.items() if not refs and name != "root"]
    while ready:
        name = ready.pop()
        rules[name].rule_is_terminal = True
        for reader in readers.get(name, ()):
            refs = waiting[reader]
            if name in refs:
                refs.discard(name)
                if not refs and reader != "root":
                    ready.append(reader)
