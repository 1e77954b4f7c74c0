"""What a JSON schema's `$ref`s refer to: its documents (the root, and each object with
an `$id`) by their URIs, and its anchors, as a validator resolves them against each
object's base URI (server/shared/grammar_ends.py walks a schema through them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urldefrag, urljoin

from server.shared.json_schemas import SCHEMA_MAPS, SCHEMAS

# What a `$ref` the check cannot resolve refers to: a schema it does not read.
UNRESOLVED = object()
# Where a schema without an `$id` of its own is held: a base its relative `$id`s and
# `$ref`s resolve against, as a validator's default one.
BASE = "https://schema.invalid/root.json"


class Resources:
    """A schema's documents (the root, and each object with an `$id`) by their URIs, its
    anchors, and the base URI of each object in it: what a `$ref` resolves against.
    Walked through the keywords whose values are schemas (a `$id` in a `const` names
    nothing), without recursion."""

    def __init__(self, root: dict[str, Any], tick: Callable[[], None]):
        self.documents: dict[str, Any] = {}
        self.anchors: dict[tuple[str, str], Any] = {}
        self.base: dict[int, str] = {}
        self.twice: set[str] = set()  # URIs given twice: which one a `$ref` means is not ours
        todo: list[tuple[Any, str]] = [(root, BASE)]
        while todo:
            tick()
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
        documents; `UNRESOLVED` for anything else (another document: llguidance resolves or
        refuses it)."""
        if not isinstance(ref, str):
            return UNRESOLVED, base
        uri, fragment = (base, ref[1:]) if ref.startswith("#") else urldefrag(_joined(base, ref))
        node = self.documents.get(uri)
        if node is None or uri in self.twice:
            return UNRESOLVED, base
        fragment = unquote(fragment)
        if fragment and not fragment.startswith("/"):
            node = self.anchors.get((uri, fragment), UNRESOLVED)
            return node, self.base.get(id(node), uri)
        for part in fragment.split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return UNRESOLVED, base
        return node, self.base.get(id(node), uri)


def _joined(base: str, ref: str) -> str:
    try:
        return urljoin(base, ref)
    except ValueError:  # not a URI (an unclosed IPv6 host): nothing of the schema's
        return "invalid:"
