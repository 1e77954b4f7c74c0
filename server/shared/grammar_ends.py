"""Grammars that can never end: no text they allow is complete (`start: "a" start`, a JSON
schema whose required property is the schema itself). llguidance compiles them and allows
their first tokens, so a session would write until its token limit without ever completing
the grammar; the verifier refuses them where it compiles them instead.

Both checks find the parts of a grammar that can produce a complete text (the productive
symbols of a context-free grammar), in time linear in its size: a part is productive once
all of what it needs is, or one of its alternatives. A part the check does not read (a rule
in llguidance's own extensions to Lark, a `$ref` to another document) may or may not end:
the graph is read twice, once with such parts productive, once not. A grammar is refused
only when it has no end either way ("never"); one that ends only with them productive is
"unknown": accepted, and the verifier bounds the tokens its sessions may generate
(VERIFIER_GRAMMAR_UNPROVEN_TOKENS), as it cannot rely on the grammar's end.

The check is pure Python, run where a grammar is compiled, before llguidance: a grammar's
size is bounded before it begins (`grammar_bounds`, server/shared/grammar_text.py) and its
time while it runs (`deadline`, checked as it walks: `CheckTimeout`), so that no grammar
under the request's size limit holds the grammar thread past the compile limit."""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from typing import Any, Literal

from lark import Tree
from lark.grammar import NonTerminal, Terminal
from lark.load_grammar import GrammarBuilder, _literal_to_pattern, _parse_grammar

from server.shared.grammar_leaves import Matches, enum_matches, regex_matches, scalar_matches
from server.shared.grammar_text import GOES_ON, CheckTimeout
from server.shared.schema_refs import BASE, UNRESOLVED, Resources

NEVER_ENDS = (
    "the grammar can never end: every way through it refers back to itself or matches nothing"
)
# What the check finds: the grammar can end; it can never end; or every way to an end it
# found goes through a part it does not read.
Ending = Literal["ends", "never", "unknown"]
_CHECK_EVERY = 1024  # steps between two reads of the clock
# The empty string, which Lark refuses as a terminal: as productive as any other terminal.
_EMPTY = re.compile(r'(?<![\\"])""(?!")')
_RULE_HEAD = re.compile(r"[?!]*(_?[a-z][_a-z0-9]*)")
_TERM_HEAD = re.compile(r"(_?[A-Z][_A-Z0-9]*)")


def _statements(text: str) -> Iterable[str]:
    """A Lark grammar's statements, each with the lines that go on it (blank lines left
    out: Lark reads a run of them as one)."""
    lines: list[str] = []
    for line in text.split("\n"):
        if not line.strip():  # blank: runs of them cost Lark's lexer their length squared
            continue
        if lines and line[0] not in GOES_ON:
            yield "\n".join(lines)
            lines = []
        lines.append(line)
    if lines:
        yield "\n".join(lines)


def grammar_end(
    kind: str, grammar: str, schema: Any = None, deadline: float | None = None
) -> Ending:
    """Whether a grammar can end. `grammar` is llguidance's grammar text for `lark` and
    `gbnf`; `schema` the object of a `json_schema`; a regex ends (each text it matches is
    finite). Past `deadline` (a `time.perf_counter()`): `CheckTimeout`."""
    clock = _Clock(deadline)
    ending: Ending = "ends"
    if kind in ("lark", "gbnf"):
        ending = _lark_ending(_EMPTY.sub('"_"', grammar), clock)
    elif kind == "json_schema":
        ending = _schema_ending(schema, clock)
    if deadline is not None and time.perf_counter() > deadline:
        raise CheckTimeout
    return ending


def never_ends(
    kind: str, grammar: str, schema: Any = None, deadline: float | None = None
) -> str | None:
    """Why a grammar can never end (None: it can, or the check cannot tell)."""
    return NEVER_ENDS if grammar_end(kind, grammar, schema, deadline) == "never" else None


class _Clock:
    def __init__(self, deadline: float | None):
        self.deadline, self.steps = deadline, 0

    def tick(self) -> None:
        self.steps += 1
        if (
            self.deadline is not None
            and self.steps % _CHECK_EVERY == 0
            and time.perf_counter() > self.deadline
        ):
            raise CheckTimeout


class _Gates:
    """An and-or graph: a gate holds once all its children do (`all`) or one (`any`).
    `unread` stands for the parts the check does not read: held or not, as asked."""

    def __init__(self, clock: _Clock) -> None:
        self.missing: list[int] = []  # children still needed before the gate holds
        self.parents: list[list[int]] = []
        self.clock = clock
        self.unread = self.new("any", 0)
        self.always, self.never = self.new("all", 0), self.new("any", 0)

    def new(self, kind: str, n_children: int) -> int:
        self.missing.append(n_children if kind == "all" else min(1, n_children) or 1)
        self.parents.append([])
        return len(self.missing) - 1

    def leaf(self, matches: Matches) -> int:
        """A leaf's gate: it holds where it matches something (grammar_leaves.py)."""
        return (
            self.always
            if isinstance(matches, int)
            else {"none": self.never}.get(matches, self.unread)
        )

    def link(self, gate: int, children: Iterable[int]) -> None:
        for child in children:
            self.parents[child].append(gate)

    def holding(self, unread_holds: bool) -> set[int]:
        missing = list(self.missing)
        if unread_holds:
            missing[self.unread] = 0
        held = {g for g, m in enumerate(missing) if m == 0}
        queue = list(held)
        while queue:
            self.clock.tick()
            for parent in self.parents[queue.pop()]:
                if parent not in held:
                    missing[parent] -= 1
                    if missing[parent] == 0:
                        held.add(parent)
                        queue.append(parent)
        return held

    def ending(self, root: int) -> Ending:
        if root not in self.holding(unread_holds=True):
            return "never"
        return "ends" if root in self.holding(unread_holds=False) else "unknown"


def _lark_ending(text: str, clock: _Clock) -> Ending:
    """From the rules and terminals as Lark parses them, each statement on its own, not as
    it compiles them: compiling multiplies out every optional and alternative (exponential
    in their nesting), and Lark's loading resolves terminals into each other (quadratic in
    their number). A statement Lark does not read (an extension of llguidance's: `%json`,
    a terminal's `&` or `~`) leaves its rule or terminal unread, whatever it refers to.
    `%import`s are never followed (they would read files of the server's): a rule they
    name is not defined here, so it is unread too; a terminal not defined here (common's
    WORD, NUMBER...) matches something."""
    builder = GrammarBuilder()
    rules: dict[str, Any] = {}  # a rule's tree; None: unread, or defined twice
    terms: dict[str, Any] = {}  # a terminal's, alike
    for statement in _statements(text):
        clock.tick()
        try:
            parsed = _parse_grammar(statement, "<?>").children
        except Exception:  # llguidance's syntax, or nested past Lark's reach: not read
            if head := _RULE_HEAD.match(statement):
                rules[head.group(1)] = None
            elif head := _TERM_HEAD.match(statement):
                terms[head.group(1)] = None
            continue
        for stmt in parsed:
            if stmt.data in ("override", "extend"):
                stmt = stmt.children[0]
                defined = rules if stmt.data == "rule" else terms
                defined[builder._unpack_definition(stmt, None)[0]] = None
            elif stmt.data in ("rule", "term"):
                name, _, tree, params, _ = builder._unpack_definition(stmt, None)
                defined = rules if stmt.data == "rule" else terms
                unread = params or name in defined  # a template, or defined again
                defined[name] = None if unread else tree
    if rules.get("start") is None:
        return "unknown"  # no start, or one the check does not read
    gates = _Gates(clock)
    lark = _LarkGates(gates, rules, terms)
    try:
        for names, trees in ((lark.terms, terms), (lark.rules, rules)):
            for name, gate in names.items():
                gates.link(gate, [lark.gate(trees[name])])
    except RecursionError:
        return "unknown"
    return gates.ending(lark.rules["start"])


class _LarkGates:
    """The gates of a Lark grammar's parts: alternatives hold once one does, a sequence
    once all do; `x?`, `x*`, `[x]` and `x ~ 0..n` always hold, `x+` and `x ~ n..m` once x
    does; a literal once its regex matches something; a rule or terminal once its
    definition does; a rule or terminal not read, and a template's use, are unread."""

    def __init__(self, gates: _Gates, rules: dict[str, Any], terms: dict[str, Any]):
        self.g = gates
        self.rules = {n: gates.new("any", 1) for n, t in rules.items() if t is not None}
        self.terms = {n: gates.new("any", 1) for n, t in terms.items() if t is not None}
        self.unread_terms = {n for n, t in terms.items() if t is None}

    def gate(self, tree: Any) -> int:
        g = self.g
        g.clock.tick()
        if isinstance(tree, NonTerminal):
            return self.rules.get(tree.name, g.unread)
        if isinstance(tree, Terminal):
            return (
                g.unread if tree.name in self.unread_terms else self.terms.get(tree.name, g.always)
            )
        if not isinstance(tree, Tree):
            return g.always
        kind, children = tree.data, tree.children
        if kind in ("expansions", "expansion", "alias"):
            parts = [self.gate(c) for c in children if not isinstance(c, str)]
            if kind == "alias":
                parts = parts[:1]
            gate = g.new("any" if kind == "expansions" else "all", len(parts))
            g.link(gate, parts)
            return gate
        if kind == "expr":
            op = str(children[1]) if len(children) > 1 else ""
            optional = op in ("?", "*") or (op == "~" and str(children[2]) == "0")
            return g.always if optional else self.gate(children[0])
        if kind == "value" and children:
            return self.gate(children[0])
        if kind == "literal" and getattr(children[0], "type", "") == "REGEXP":
            return g.leaf(_lark_regex(children[0]))
        if kind == "template_usage":
            return g.unread
        return g.always  # a string, a range, `[x]`


def _lark_regex(token: Any) -> Matches:
    try:
        pattern = _literal_to_pattern(token).to_regexp()
    except Exception:  # Lark's own refusal: llguidance's to say
        return "unread"
    return regex_matches(pattern)


def _schema_ending(schema: Any, clock: _Clock) -> Ending:
    if schema is True:  # any value
        return "ends"
    if not isinstance(schema, dict):
        return "unknown"
    walk = _SchemaWalk(schema, clock)
    return walk.gates.ending(walk.root)


class _SchemaWalk:
    """A schema's and-or graph: a subschema holds once its `$ref`, its `allOf`, one of each
    `anyOf`/`oneOf`, and what its type needs hold. Subschemas are the schema's own objects,
    known by identity (a `$ref` cycle is a cycle of gates)."""

    def __init__(self, schema: dict[str, Any], clock: _Clock):
        self.gates, self.clock = _Gates(clock), clock
        self.seen: dict[int, int] = {}  # a subschema's id(): its gate
        self.resources = Resources(schema, clock.tick)
        self.always, self.never = self.gates.always, self.gates.never
        self.work: list[tuple[dict[str, Any], str]] = []
        self.root = self.gate(schema, BASE)
        while self.work:
            clock.tick()
            node, base = self.work.pop()
            needed: list[int] = []
            if "$ref" in node:
                needed.append(self.gate(*self.resources.resolve(node["$ref"], base)))
            needed += [self.gate(s, base) for s in _list(node.get("allOf"))]
            needed += [self.one_of(_list(node.get(k)), base) for k in ("anyOf", "oneOf")]
            if (clause := self.typed(node, base)) is not None:
                needed.append(clause)
            me = self.seen[id(node)]
            self.gates.missing[me] = len(needed)
            self.gates.link(me, needed)

    def gate(self, node: Any, base: str) -> int:
        if node is False:
            return self.never
        if node is UNRESOLVED:
            return self.gates.unread
        if not isinstance(node, dict):
            return self.always
        if id(node) not in self.seen:
            self.seen[id(node)] = self.gates.new("all", 0)
            self.work.append((node, self.resources.base.get(id(node), base)))
        return self.seen[id(node)]

    def combined(self, kind: str, children: list[int]) -> int:
        combined = self.gates.new(kind, len(children))
        self.gates.link(combined, children)
        return combined

    def one_of(self, nodes: list[Any], base: str) -> int:
        return self.combined("any", [self.gate(n, base) for n in nodes]) if nodes else self.always

    def typed(self, node: dict[str, Any], base: str) -> int | None:
        """What the schema's types need, one type's enough: an object its required keys,
        an array its first items, a scalar a value within its bounds; a `const` or an
        `enum` one of its values of those types (grammar_leaves.py). None: no type."""
        types = node.get("type")
        types = [types] if isinstance(types, str) else types
        named = types if isinstance(types, list) and types else None
        if "const" in node or "enum" in node:
            return self.gates.leaf(enum_matches(node, named))
        if named is None:
            return None
        ways = [self.gates.unread if not isinstance(t, str) else self.of_type(node, t, base)
            for t in named]  # fmt: skip
        return self.combined("any", ways)

    def of_type(self, node: dict[str, Any], kind: str, base: str) -> int:
        if kind not in ("object", "array"):
            return self.gates.leaf(scalar_matches(node, kind))
        words = ("minProperties", "maxProperties") if kind == "object" else ("minItems", "maxItems")
        most = node.get(words[1])
        if isinstance(most, int) and _count(node.get(words[0])) > most:
            return self.gates.never
        if kind == "object":
            return self.combined("all", self.object_needs(node, base))
        n_items = _count(node.get("minItems"))
        prefix = _list(node.get("prefixItems"))[:n_items]
        needs = [self.gate(n, base) for n in prefix]
        if n_items > len(prefix):
            needs.append(self.gate(node.get("items", True), base))
        if "contains" in node and _count(node.get("minContains", 1)):
            needs.append(self.gate(node["contains"], base))
        return self.combined("all", needs)

    def object_needs(self, node: dict[str, Any], base: str) -> list[int]:
        """An object's required keys' values, each the schema its key is held to: its
        property's, or where it lists none, `additionalProperties`' (or, where patterns may
        name it, one of theirs: which the key matches is not read); and where
        `minProperties` asks for more keys than those, one more of any of them."""
        properties = node.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        patterns = node.get("patternProperties")
        patterns = list(patterns.values()) if isinstance(patterns, dict) else []
        other = [self.gate(node.get("additionalProperties", True), base)]
        if patterns:
            other = [self.combined("any", [*other, *(self.gate(p, base) for p in patterns)])]
        required = list(dict.fromkeys(n for n in _list(node.get("required")) if isinstance(n, str)))
        needs = [self.gate(properties[n], base) if n in properties else other[0] for n in required]
        if _count(node.get("minProperties")) > len(required):
            optional = [self.gate(s, base) for n, s in properties.items() if n not in required]
            needs.append(self.combined("any", [*optional, *other]))
        return needs


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []
