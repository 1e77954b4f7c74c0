"""A JSON schema as a grammar holds it, the way llama.cpp's grammars, xgrammar and outlines
(and vLLM's guidance backend) hold one: an object is closed unless the schema opens it,
and whitespace is bounded. Read to the letter, a schema without `additionalProperties`
allows any other key, and JSON allows any run of whitespace: a model under such a grammar
may invent keys (`"name_2"`, ...) or write blank lines until its token limit.

Pure, and walked without recursion: a schema nests as deep as a request body may. The
verifier and the drafter both compile a schema through `held_schema`
(server/shared/constraint.py), so both decode under the same grammar."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# llama.cpp's `space` rule (json-schema-to-grammar): one space, or a line break or two and
# an indent. llguidance makes it optional wherever JSON allows whitespace and matches it at
# most once there, so a run of whitespace is bounded.
WHITESPACE = " |\n{1,2}[ \t]{0,20}"
GUIDANCE = "x-guidance"  # llguidance's options, read at a schema's top level only
# Keywords whose value is a schema, a list of them, or a map of them (JSON Schema's).
SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}
)
SCHEMAS = frozenset(
    {
        "allOf",
        "anyOf",
        "oneOf",
        "not",
        "if",
        "then",
        "else",
        "items",
        "prefixItems",
        "additionalItems",
        "contains",
        "additionalProperties",
        "unevaluatedProperties",
        "unevaluatedItems",
        "propertyNames",
    }
)
# Where a schema is one part of an intersection or a condition: closed there, it would
# refuse the keys the other parts allow (llguidance then calls the schema unsatisfiable).
PARTIAL = frozenset({"allOf", "not", "if", "then", "else", "dependentSchemas", "dependencies"})
# What opens an object (or leaves its keys to another keyword) where a schema says it.
OPENERS = ("additionalProperties", "unevaluatedProperties", "allOf", "$ref", "anyOf", "oneOf")
# Alternatives that, beside properties of their own, are each intersected with them: a
# tagged union whose branches repeat the tag and add their own keys.
ALTERNATIVES = ("anyOf", "oneOf")
OWN_KEYS = ("properties", "patternProperties", "required")


def held_schema(schema: Any) -> Any:
    """`schema` as the grammar holds it (a copy; the schema itself is unchanged): every
    object schema with `properties` or `patternProperties` and nothing that opens it gets
    `additionalProperties: false`, and whitespace is bounded (`WHITESPACE`) unless the
    schema's own `x-guidance` says how. Anything but an object is returned as it is."""
    if not isinstance(schema, dict):
        return schema
    root = _copied(schema)
    nodes = list(_subschemas(root))
    shared = {pointer for node, _, _ in nodes for pointer in _refs_intersected(node)}
    for node, pointer, whole in nodes:
        if whole and pointer not in shared and _closable(node):
            node["additionalProperties"] = False
    options = root.get(GUIDANCE)
    if options is None:
        root[GUIDANCE] = {"whitespace_pattern": WHITESPACE}
    elif isinstance(options, dict) and not {"whitespace_pattern", "whitespace_flexible"} & set(
        options
    ):
        root[GUIDANCE] = {**options, "whitespace_pattern": WHITESPACE}
    return root


def _closable(node: dict[str, Any]) -> bool:
    """An object whose keys are listed and that nothing opens; not one whose required keys
    go beyond them (closed, it could never be written)."""
    listed = node.get("properties")
    if not isinstance(listed, dict) and not isinstance(node.get("patternProperties"), dict):
        return False
    if any(word in node for word in OPENERS):
        return False
    required = node.get("required")
    required = list(required) if isinstance(required, list) else []
    dependent = node.get("dependentRequired")
    if isinstance(dependent, dict):
        required += [
            name for names in dependent.values() if isinstance(names, list) for name in names
        ]
    listed = listed if isinstance(listed, dict) else {}
    if "patternProperties" not in node:
        return all(name in listed for name in required)
    return True


def _refs_intersected(node: dict[str, Any]) -> list[str]:
    """The places (JSON pointers) of the schemas `node` intersects with others by
    reference: its `allOf` members' `$ref`s, where it has more than the one member, its
    own `$ref` where it lists properties of its own too, and its alternatives' `$ref`s
    beside keys of its own."""
    own = any(word in node for word in ("properties", "patternProperties", "$ref"))
    parts = node.get("allOf")
    parts = parts if isinstance(parts, list) else []
    refs = [p.get("$ref") for p in parts if isinstance(p, dict)] if own or len(parts) > 1 else []
    if "properties" in node or "patternProperties" in node:
        refs.append(node.get("$ref"))
    if any(word in node for word in OWN_KEYS):
        for word in ALTERNATIVES:
            members = node.get(word)
            members = members if isinstance(members, list) else []
            refs += [m.get("$ref") for m in members if isinstance(m, dict)]
    return [ref[1:] for ref in refs if isinstance(ref, str) and ref[:1] == "#"]


def _subschemas(root: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str, bool]]:
    """Each object schema in `root`, with its JSON pointer ("" for the root) and whether
    it stands whole (not a part of an intersection or a condition); level by level."""
    todo: list[tuple[Any, str, bool]] = [(root, "", True)]
    while todo:
        node, pointer, whole = todo.pop()
        if not isinstance(node, dict):
            continue
        yield node, pointer, whole
        beside_own = any(word in node for word in OWN_KEYS)
        for word, value in node.items():
            part = word in PARTIAL or (word in ALTERNATIVES and beside_own)
            at, part_whole = f"{pointer}/{_escaped(word)}", not part
            if word in SCHEMA_MAPS and isinstance(value, dict):
                todo += [(v, f"{at}/{_escaped(k)}", part_whole) for k, v in value.items()]
            elif word in SCHEMAS and isinstance(value, list):
                todo += [(v, f"{at}/{i}", part_whole) for i, v in enumerate(value)]
            elif word in SCHEMAS:
                todo.append((value, at, part_whole))


def _escaped(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _copied(value: Any) -> Any:
    """A copy of a JSON value, its objects and arrays each new (level by level)."""
    holder = [value]
    todo: list[tuple[Any, Any]] = [(holder, 0)]
    while todo:
        parent, key = todo.pop()
        item = parent[key]
        if isinstance(item, dict):
            parent[key] = copy = dict(item)
            todo += [(copy, k) for k in copy]
        elif isinstance(item, list):
            parent[key] = items = list(item)
            todo += [(items, i) for i in range(len(items))]
    return holder[0]
