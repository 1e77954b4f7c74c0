"""Grammars that can never end: no text they allow is complete (`start: "a" start`, a JSON
schema whose required property is the schema itself). llguidance compiles them and allows
their first tokens, so a session would write until its token limit without ever completing
the grammar; the verifier refuses them where it compiles them instead.

Both checks find the parts of a grammar that can produce a complete text (the productive
symbols of a context-free grammar), in time linear in its size: a part is productive once
all of what it needs is, or one of its alternatives. They are conservative: a grammar is
refused only when proven empty, and a syntax the check does not read (llguidance's own
extensions to Lark, a `$ref` outside the schema) passes to llguidance as it is."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from lark import Tree
from lark.grammar import NonTerminal
from lark.load_grammar import GrammarBuilder

NEVER_ENDS = "the grammar can never end: every way through it refers back to itself"
_HEADER = re.compile(r"\A%llguidance \{[^\n]*\}\s*")  # what llguidance's GBNF conversion adds
# The empty string, which Lark refuses as a terminal: as productive as any other terminal.
_EMPTY = re.compile(r'(?<![\\"])""(?!")')
_IMPORT = re.compile(r"^\s*%import", re.MULTILINE)


def never_ends(kind: str, grammar: str, schema: Any = None) -> str | None:
    """Why a grammar can never end (None: it can, or the check cannot tell). `grammar` is
    llguidance's grammar text for `lark` and `gbnf`; `schema` the object of a
    `json_schema`."""
    if kind in ("lark", "gbnf"):
        productive = _lark_productive(_EMPTY.sub('"_"', _HEADER.sub("", grammar)))
    elif kind == "json_schema":
        productive = _schema_productive(schema)
    else:
        return None
    return None if productive is not False else NEVER_ENDS


class _Gates:
    """An and-or graph: a gate holds once all its children do (`all`) or one (`any`)."""

    def __init__(self) -> None:
        self.missing: list[int] = []  # children still needed before the gate holds
        self.parents: list[list[int]] = []

    def new(self, kind: str, n_children: int) -> int:
        self.missing.append(n_children if kind == "all" else min(1, n_children) or 1)
        self.parents.append([])
        return len(self.missing) - 1

    def link(self, gate: int, children: Iterable[int]) -> None:
        for child in children:
            self.parents[child].append(gate)

    def holding(self) -> set[int]:
        held = {g for g, m in enumerate(self.missing) if m == 0}
        queue = list(held)
        while queue:
            for parent in self.parents[queue.pop()]:
                if parent not in held:
                    self.missing[parent] -= 1
                    if self.missing[parent] == 0:
                        held.add(parent)
                        queue.append(parent)
        return held


def _lark_productive(text: str) -> bool | None:
    """From the rules as Lark parses them, not as it compiles them: compiling multiplies
    out every optional and alternative (exponential in their nesting)."""
    if _IMPORT.search(text):
        return None  # `%import` would read files of the server's: never followed
    try:
        builder = GrammarBuilder()
        builder.load_grammar(text)
        definitions = builder._definitions
    except Exception:  # a syntax Lark does not read (or any failure of it): llguidance decides
        return None
    rules = {n: d for n, d in definitions.items() if not d.is_term}
    if "start" not in rules or any(d.params for d in rules.values()):
        return None  # no start, or templates: not this check's to read
    gates = _Gates()
    always = gates.new("all", 0)
    names = {name: gates.new("any", 1) for name in rules}
    try:
        for name, definition in rules.items():
            gates.link(names[name], [_lark_gate(definition.tree, gates, names, always)])
    except RecursionError:
        return None
    return names["start"] in gates.holding()


def _lark_gate(tree: Any, gates: _Gates, names: dict[str, int], always: int) -> int:
    """The gate of a part of a rule: alternatives hold once one does, a sequence once all
    do; `x?`, `x*`, `[x]` and `x ~ 0..n` always hold, `x+` and `x ~ n..m` once x does; a
    terminal always holds."""
    if isinstance(tree, NonTerminal):
        return names.get(tree.name, always)
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
    return always  # a literal, a terminal, `[x]`, a template's use


def _schema_productive(schema: Any) -> bool | None:
    if not isinstance(schema, dict) or _nested_ids(schema):
        return None  # a `$id` inside changes what its pointers mean: not this check's to read
    walk = _SchemaWalk(schema)
    return walk.root in walk.gates.holding()


class _SchemaWalk:
    """A schema's and-or graph: a subschema holds once its `$ref`, its `allOf`, one of each
    `anyOf`/`oneOf`, and what its type needs hold. Subschemas are the schema's own objects,
    known by identity (a `$ref` cycle is a cycle of gates)."""

    def __init__(self, schema: dict):
        self.schema, self.gates, self.seen = schema, _Gates(), {}
        self.always, self.never = self.gates.new("all", 0), self.gates.new("any", 0)
        self.work: list[dict] = []
        self.root = self.gate(schema)
        while self.work:
            node = self.work.pop()
            needed = [self.gate(_resolve(schema, node["$ref"]))] if "$ref" in node else []
            needed += [self.gate(s) for s in _list(node.get("allOf"))]
            needed += [self.one_of(_list(node.get(k))) for k in ("anyOf", "oneOf")]
            if (clause := self.typed(node)) is not None:
                needed.append(clause)
            me = self.seen[id(node)]
            self.gates.missing[me] = len(needed)
            self.gates.link(me, needed)

    def gate(self, node: Any) -> int:
        if node is False:
            return self.never
        if not isinstance(node, dict):
            return self.always
        if id(node) not in self.seen:
            self.seen[id(node)] = self.gates.new("all", 0)
            self.work.append(node)
        return self.seen[id(node)]

    def combined(self, kind: str, children: list[int]) -> int:
        combined = self.gates.new(kind, len(children))
        self.gates.link(combined, children)
        return combined

    def one_of(self, nodes: list) -> int:
        return self.combined("any", [self.gate(n) for n in nodes]) if nodes else self.always

    def typed(self, node: dict) -> int | None:
        """What an object or array schema needs (None: a value of another type, a `const`
        or an `enum` completes it)."""
        types = node.get("type")
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not types or "const" in node or "enum" in node:
            return None
        if any(t not in ("object", "array") for t in types):
            return None
        ways = []
        if "object" in types:
            properties = node.get("properties")
            properties = properties if isinstance(properties, dict) else {}
            required = _list(node.get("required"))
            needs = [properties[n] for n in required if isinstance(n, str) and n in properties]
            ways.append(self.combined("all", [self.gate(n) for n in needs]))
        if "array" in types:
            n_items = node.get("minItems", 0)
            n_items = n_items if isinstance(n_items, int) else 0
            prefix = _list(node.get("prefixItems"))[:n_items]
            rest = [node.get("items", True)] if n_items > len(prefix) else []
            ways.append(self.combined("all", [self.gate(n) for n in prefix + rest]))
        return self.combined("any", ways)


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _nested_ids(schema: dict) -> bool:
    """Whether an object below the root has an `$id` (walked without recursion)."""
    stack: list[Any] = list(schema.values())
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "$id" in node:
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _resolve(root: dict, ref: Any) -> Any:
    """A `$ref` that is a JSON pointer into the schema (`#`, `#/...`); True, which holds,
    for any other (an anchor, another document: llguidance resolves or refuses it)."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return True
    node: Any = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return True
    return node
