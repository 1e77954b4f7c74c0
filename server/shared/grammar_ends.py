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
from urllib.parse import unquote, urldefrag, urljoin

from lark import Tree
from lark.grammar import NonTerminal
from lark.load_grammar import GrammarBuilder, _parse_grammar

from server.shared.grammar_text import GOES_ON, CheckTimeout
from server.shared.json_schemas import SCHEMA_MAPS, SCHEMAS

NEVER_ENDS = "the grammar can never end: every way through it refers back to itself"
# What the check finds: the grammar can end; it can never end; or every way to an end it
# found goes through a part it does not read.
Ending = Literal["ends", "never", "unknown"]
_CHECK_EVERY = 1024  # steps between two reads of the clock
# The empty string, which Lark refuses as a terminal: as productive as any other terminal.
_EMPTY = re.compile(r'(?<![\\"])""(?!")')
_RULE_HEAD = re.compile(r"[?!]*(_?[a-z][_a-z0-9]*)")


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

    def new(self, kind: str, n_children: int) -> int:
        self.missing.append(n_children if kind == "all" else min(1, n_children) or 1)
        self.parents.append([])
        return len(self.missing) - 1

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
    """From the rules as Lark parses them, each statement on its own, not as it compiles
    them: compiling multiplies out every optional and alternative (exponential in their
    nesting), and Lark's loading resolves terminals into each other (quadratic in their
    number; a terminal is productive whatever it is). A statement Lark does not read (an
    extension of llguidance's) leaves its rule unread, whatever it refers to. `%import`s
    are never followed (they would read files of the server's): a rule they name is not
    defined here, so it is unread too (a terminal is productive, whatever it is)."""
    builder = GrammarBuilder()
    definitions: dict[str, Any] = {}  # a rule's tree; None: unread, or defined twice
    for statement in _statements(text):
        clock.tick()
        try:
            parsed = _parse_grammar(statement, "<?>").children
        except Exception:  # llguidance's syntax, or nested past Lark's reach: not read
            head = _RULE_HEAD.match(statement)
            if head:
                definitions[head.group(1)] = None
            continue
        for stmt in parsed:
            if stmt.data in ("override", "extend"):
                stmt = stmt.children[0]
                if stmt.data == "rule":
                    definitions[builder._unpack_definition(stmt, None)[0]] = None
            elif stmt.data == "rule":
                name, _, tree, params, _ = builder._unpack_definition(stmt, None)
                unread = params or name in definitions  # a template, or defined again
                definitions[name] = None if unread else tree
    rules = {name: tree for name, tree in definitions.items() if tree is not None}
    if "start" not in rules:
        return "unknown"  # no start, or one the check does not read
    gates = _Gates(clock)
    always = gates.new("all", 0)
    names = {name: gates.new("any", 1) for name in rules}
    try:
        for name, tree in rules.items():
            gates.link(names[name], [_lark_gate(tree, gates, names, always)])
    except RecursionError:
        return "unknown"
    return gates.ending(names["start"])


def _lark_gate(tree: Any, gates: _Gates, names: dict[str, int], always: int) -> int:
    """The gate of a part of a rule: alternatives hold once one does, a sequence once all
    do; `x?`, `x*`, `[x]` and `x ~ 0..n` always hold, `x+` and `x ~ n..m` once x does; a
    terminal always holds; a rule not read, and a template's use, are unread."""
    gates.clock.tick()
    if isinstance(tree, NonTerminal):
        return names.get(tree.name, gates.unread)
    if not isinstance(tree, Tree):
        return always
    kind, children = tree.data, tree.children
    if kind in ("expansions", "expansion", "alias"):
        parts = [_lark_gate(c, gates, names, always) for c in children if not isinstance(c, str)]
        if kind == "alias":
            parts = parts[:1]
        gate = gates.new("any" if kind == "expansions" else "all", len(parts))
        gates.link(gate, parts)
        return gate
    if kind == "expr":
        op = str(children[1]) if len(children) > 1 else ""
        optional = op in ("?", "*") or (op == "~" and str(children[2]) == "0")
        return always if optional else _lark_gate(children[0], gates, names, always)
    if kind == "value" and children:
        return _lark_gate(children[0], gates, names, always)
    if kind == "template_usage":
        return gates.unread
    return always  # a literal, a terminal, `[x]`


def _schema_ending(schema: Any, clock: _Clock) -> Ending:
    if schema is True:  # any value
        return "ends"
    if not isinstance(schema, dict):
        return "unknown"
    walk = _SchemaWalk(schema, clock)
    return walk.gates.ending(walk.root)


# What a `$ref` the check cannot resolve refers to: a schema it does not read.
UNREAD = object()
# Where a schema without an `$id` of its own is held: a base its relative `$id`s and
# `$ref`s resolve against, as a validator's default one.
_BASE = "https://schema.invalid/root.json"


class _Resources:
    """A schema's documents (the root, and each object with an `$id`) by their URIs, its
    anchors, and the base URI of each object in it: what a `$ref` resolves against.
    Walked through the keywords whose values are schemas (a `$id` in a `const` names
    nothing), without recursion."""

    def __init__(self, root: dict[str, Any], clock: _Clock):
        self.documents: dict[str, Any] = {}
        self.anchors: dict[tuple[str, str], Any] = {}
        self.base: dict[int, str] = {}
        self.twice: set[str] = set()  # URIs given twice: which one a `$ref` means is not ours
        todo: list[tuple[Any, str]] = [(root, _BASE)]
        while todo:
            clock.tick()
            node, base = todo.pop()
            if not isinstance(node, dict):
                continue
            own = node.get("$id")
            if isinstance(own, str):
                uri, fragment = urldefrag(_joined(base, own))
                if uri:
                    base = uri
                    self._document(uri, node)
                if fragment:  # draft 7's `"$id": "#name"`: an anchor
                    self.anchors.setdefault((base, fragment), node)
            elif node is root:
                self._document(base, node)
            self.base[id(node)] = base
            for word in ("$anchor", "$dynamicAnchor"):
                if isinstance(node.get(word), str):
                    self.anchors.setdefault((base, node[word]), node)
            for word, value in node.items():
                if word in SCHEMA_MAPS and isinstance(value, dict):
                    todo += [(v, base) for v in value.values()]
                elif word in SCHEMAS and isinstance(value, list):
                    todo += [(v, base) for v in value]
                elif word in SCHEMAS:
                    todo.append((value, base))

    def _document(self, uri: str, node: dict[str, Any]) -> None:
        if uri in self.documents and self.documents[uri] is not node:
            self.twice.add(uri)
        self.documents[uri] = node

    def resolve(self, ref: Any, base: str) -> tuple[Any, str]:
        """What a `$ref` found at `base` refers to, and its base: a JSON pointer (its
        fragment percent-decoded first, as a URI's) or an anchor into one of the schema's
        documents; `UNREAD` for anything else (another document: llguidance resolves or
        refuses it)."""
        if not isinstance(ref, str):
            return UNREAD, base
        uri, fragment = (base, ref[1:]) if ref.startswith("#") else urldefrag(_joined(base, ref))
        node = self.documents.get(uri)
        if node is None or uri in self.twice:
            return UNREAD, base
        fragment = unquote(fragment)
        if fragment and not fragment.startswith("/"):
            node = self.anchors.get((uri, fragment), UNREAD)
            return node, self.base.get(id(node), uri)
        for part in fragment.split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return UNREAD, base
        return node, self.base.get(id(node), uri)


def _joined(base: str, ref: str) -> str:
    try:
        return urljoin(base, ref)
    except ValueError:  # not a URI (an unclosed IPv6 host): nothing of the schema's
        return "invalid:"


class _SchemaWalk:
    """A schema's and-or graph: a subschema holds once its `$ref`, its `allOf`, one of each
    `anyOf`/`oneOf`, and what its type needs hold. Subschemas are the schema's own objects,
    known by identity (a `$ref` cycle is a cycle of gates)."""

    def __init__(self, schema: dict[str, Any], clock: _Clock):
        self.gates, self.clock = _Gates(clock), clock
        self.seen: dict[int, int] = {}  # a subschema's id(): its gate
        self.resources = _Resources(schema, clock)
        self.always, self.never = self.gates.new("all", 0), self.gates.new("any", 0)
        self.work: list[tuple[dict[str, Any], str]] = []
        self.root = self.gate(schema, _BASE)
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
        if node is UNREAD:
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
        """What an object or array schema needs (None: a value of another type, a `const`
        or an `enum` completes it)."""
        types = node.get("type")
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not types or "const" in node or "enum" in node:
            return None
        if any(t not in ("object", "array") for t in types):
            return None
        ways: list[int] = []
        if "object" in types:
            ways.append(self.combined("all", self.object_needs(node, base)))
        if "array" in types:
            n_items = _count(node.get("minItems"))
            prefix = _list(node.get("prefixItems"))[:n_items]
            needs = [self.gate(n, base) for n in prefix]
            if n_items > len(prefix):
                needs.append(self.gate(node.get("items", True), base))
            if "contains" in node and _count(node.get("minContains", 1)):
                needs.append(self.gate(node["contains"], base))
            ways.append(self.combined("all", needs))
        return self.combined("any", ways)

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
