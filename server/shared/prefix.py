"""Token sequences against each other: how much of a cache a new sequence can keep."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
