"""Strict fields for the request of an API translated at the edge (Responses, Messages):
a field no version of the API has is a 400 that names the closest real one; a field that
would change the output and is not supported is a 400 naming it, unless it holds the
value that changes nothing; fields that change nothing here are accepted and ignored."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from drafter.serve.chat_api import MAX_ARGUMENTS_DEPTH
from drafter.serve.errors import OpenAIError, invalid_request


class EdgeRequest(BaseModel):
    # Checked by hand (drafter/serve/replies.py: check_fields): an error names the field.
    model_config = ConfigDict(extra="allow")

    IGNORED: ClassVar[frozenset[str]] = frozenset()
    # Field: the values that change nothing (a field absent is None).
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {}
    WHY: ClassVar[dict[str, str]] = {}  # a refused field: what to do instead

    def why_unsupported(self, name: str) -> str:
        return self.WHY.get(name, "")

    def unsupported_fields(self) -> list[str]:
        given = {**(self.model_extra or {}), **self.model_dump(include=set(self.REFUSED))}
        return sorted(name for name, ok in self.REFUSED.items() if given.get(name) not in ok)

    def unknown_fields(self) -> list[str]:
        known = set(type(self).model_fields) | self.REFUSED.keys() | self.IGNORED
        return sorted(set(self.model_extra or {}) - known)

    def known_fields(self) -> list[str]:
        return [*type(self).model_fields, *self.REFUSED, *self.IGNORED]


def nested_depth(value: Any) -> int:
    """How deep a parsed JSON value's arrays and objects nest, found without recursing
    (recursion is what a deep value breaks: json's encoder, pydantic's serializer)."""
    deepest = 0
    todo = [(value, 1)]
    while todo:
        node, depth = todo.pop()
        children: Iterable[Any]
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        todo += [(child, depth + 1) for child in children]
    return deepest


def not_too_deep(value: Any) -> Any:
    """A schema or arguments a client sent: written again into prompts and responses, so
    held to the depth chat's replayed arguments are held to."""
    if value is not None and nested_depth(value) > MAX_ARGUMENTS_DEPTH:
        raise ValueError(f"nested deeper than {MAX_ARGUMENTS_DEPTH} levels")
    return value


def edge_error(exc: ValidationError, fields: dict[str, str]) -> OpenAIError:
    """A refusal of the translated chat request, in the edge API's words: its field names
    (`fields` maps chat's to them), without pydantic's prefixes."""
    first = exc.errors()[0]
    loc = [str(part) for part in first.get("loc", ())]
    field = fields.get(loc[0], loc[0]) if loc else None
    message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    return invalid_request(f"{field}: {message}" if field else message, param=field)
