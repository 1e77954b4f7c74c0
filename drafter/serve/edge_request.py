"""Strict fields for the request of an API translated at the edge (Responses, Messages):
a field no version of the API has is a 400 that names the closest real one; a field that
would change the output and is not supported is a 400 naming it, unless it holds the
value that changes nothing; fields that change nothing here are accepted and ignored."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


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
