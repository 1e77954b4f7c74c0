"""The bytes the process's heap holds allocated: how a compiled grammar's memory is
measured (server/shared/constraint.py), before and after its compile."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in [
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        ]
    ]


def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):  # not glibc 2.33 or later (macOS, musl)
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2()


def allocated_bytes() -> int:
    """The bytes the process's heap holds allocated (glibc's `mallinfo2`, which llguidance's
    allocations go through; memory freed is counted out, unlike the resident size, which
    a later compile would reuse unseen); 0 where it cannot say."""
    if _MALLINFO2 is None:
        return 0
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)
