"""What this machine lends a model: the cores this process may use, the memory free for
a KV cache, and the context each session gets from it. No llama_cpp here: the runtime
(server/shared/runtime.py) asks llama.cpp for its devices and passes their facts in."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# A session's context is a multiple of this, as llama.cpp pads its KV cache.
CONTEXT_STEP = 256
# Where a model does not say what it was trained for, the context it gets.
FALLBACK_CONTEXT = 2048


def usable_cores(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The cores this process may use: its CPU affinity (what `taskset` or a cpuset
    allows), capped by a CPU quota (cgroup v2 `cpu.max`, as `docker --cpus` and
    Kubernetes limits set it); not the machine's count, nor llama.cpp's fixed default."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS: no affinity API
        cores = os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota here
    return cores


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int:
    """Bytes of system memory a new allocation can have without swapping: Linux's
    MemAvailable, else (macOS) the physical memory, of which the caller takes a share."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


@dataclass(frozen=True, slots=True)
class ContextChoice:
    """The context each session gets, and what decided it: the setting (`asked`), the
    model's trained context (`trained`), or the memory for the KV cache (`budget`)."""

    n_ctx: int
    source: Literal["asked", "trained", "budget"]


def session_context(
    *,
    asked: int,
    n_ctx_train: int,
    kv_bytes_per_token: int,
    n_sessions: int,
    budget_bytes: int,
    room: int = 0,
) -> ContextChoice:
    """A session's context in tokens. `asked` (not 0) is taken as it is. Otherwise the
    model's trained context, less the `room` each session keeps past its context for the
    widest pass (so that no position goes past what the model was trained on), where
    `n_sessions` sessions of it fit the KV budget; where they do not, the most that fits,
    in steps of CONTEXT_STEP, never less than FALLBACK_CONTEXT (or the trained context
    where that is less): fewer sessions give each a longer context."""
    if asked:
        return ContextChoice(asked, "asked")
    trained = (n_ctx_train if n_ctx_train > 0 else FALLBACK_CONTEXT) - room
    floor = min(trained, FALLBACK_CONTEXT)
    if kv_bytes_per_token <= 0 or budget_bytes <= 0:
        return ContextChoice(trained, "trained")
    fits = budget_bytes // (kv_bytes_per_token * max(1, n_sessions)) - room
    if fits >= trained:
        return ContextChoice(trained, "trained")
    return ContextChoice(max(floor, fits // CONTEXT_STEP * CONTEXT_STEP), "budget")
