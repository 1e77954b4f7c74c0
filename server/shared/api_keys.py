"""API keys: a set of keys, and the key a request presents.

Keys are compared in constant time as SHA-256 digests, against every configured key
with no early exit (vLLM's CVE-2025-59425 was a timing leak in its key check).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path

ANONYMOUS = "anonymous"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeys:
    def __init__(self, keys: Iterable[str]):
        self._digests = [_digest(k) for k in keys if k]

    @classmethod
    def from_settings(cls, keys: str, key_file: Path | None) -> ApiKeys:
        found = [k.strip() for k in keys.split(",")]
        if key_file is not None:
            found += [
                line.strip()
                for line in key_file.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")
            ]
        return cls(found)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def identify(self, presented: str | None, prefix: str = "key") -> str | None:
        """The identity of a valid key ("key-N"), else None; constant time per key."""
        if not self.enabled:
            return ANONYMOUS
        if presented is None:
            return None
        digest = _digest(presented)
        match = None
        for index, known in enumerate(self._digests):
            if hmac.compare_digest(digest, known):
                match = index
        return None if match is None else f"{prefix}-{match}"


def presented_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        lower = name.lower()
        if lower == b"x-api-key":
            return value.decode("latin-1").strip()
        if lower == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None
