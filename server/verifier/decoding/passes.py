"""Which rounds share a forward pass, and in what shape: a pure plan.

llama.cpp runs a decode as one forward pass only if its sequences' ids rise by one and
each has as many rows (server/shared/batching.py, `forward_passes`). So a pass here is a
range of sequence ids, each with `width` rows: a round's own rows and padding after its
last real row, or, for a sequence in the range with no round, filler rows after its last
cell. Causal attention keeps earlier rows from seeing later ones, and every padding or
filler cell is removed after the pass, so neither changes a number of a real row.

Free shapes (`plan_passes`): the rounds waiting now, in the fewest-cost passes, where a
pass costs `pass_cost_rows` rows of compute plus its rows (the startup probe measures
the ratio: on a GPU a pass costs far more than a row, on a CPU less). Pinned shapes
(`plan_pinned`): every pass spans every sequence with `width` rows each, whatever is
waiting, so every row is computed by the same kernels in every pass (builds whose
kernels change with the row count); with `pinned_logits` the steps llama.cpp runs on
output rows only too (the last layer's feed-forward part, the output projection): every
row's logits are computed, whichever are read (builds whose kernels there change with
those rows' number, as CUDA's do). Either way no pass exceeds the rows the probe
proved.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PassPlan:
    """Sequences `first`..`last`, `width` rows each; `jobs` are the sequence ids in it
    with work of their own (the others get filler rows); `every_logit`: every row's logits
    computed."""

    first: int
    last: int
    width: int
    jobs: tuple[int, ...]
    every_logit: bool = False

    @property
    def rows(self) -> int:
        return (self.last - self.first + 1) * self.width


@dataclass(frozen=True)
class PassShapes:
    """The shapes the probe proved: a pass's most rows; with `pinned_width`, every pass
    is `n_seq` sequences of exactly that many rows (and with `pinned_logits`, every row's
    logits computed)."""

    n_seq: int
    max_rows: int
    pass_cost_rows: float
    pinned_width: int = 0
    pinned_logits: bool = False

    def plan(self, rows_by_seq: dict[int, int]) -> list[PassPlan]:
        if self.pinned_width:
            return plan_pinned(rows_by_seq, self.n_seq, self.pinned_width, self.pinned_logits)
        return plan_passes(rows_by_seq, self.max_rows, self.pass_cost_rows)


def plan_pinned(
    rows_by_seq: dict[int, int], n_seq: int, width: int, every_logit: bool = False
) -> list[PassPlan]:
    if not rows_by_seq:
        return []
    if max(rows_by_seq.values()) > width:
        raise ValueError(f"a job of {max(rows_by_seq.values())} rows in passes {width} wide")
    return [PassPlan(0, n_seq - 1, width, tuple(sorted(rows_by_seq)), every_logit)]


def plan_passes(
    rows_by_seq: dict[int, int], max_rows: int, pass_cost_rows: float
) -> list[PassPlan]:
    """The passes, fewest-cost first in sequence order, covering every job. Dynamic
    programming over the jobs in sequence order: the last pass takes jobs i..j."""
    seqs = sorted(rows_by_seq)
    if not seqs:
        return []
    if max(rows_by_seq.values()) > max_rows:
        raise ValueError(f"a job of {max(rows_by_seq.values())} rows in passes of {max_rows}")
    n = len(seqs)
    best = [0.0] * (n + 1)  # best[j]: the cost of covering the first j jobs
    cut = [0] * (n + 1)  # where the last pass of that best plan starts
    for j in range(1, n + 1):
        best[j] = float("inf")
        width = 0
        for i in range(j, 0, -1):  # the last pass takes jobs i-1 .. j-1
            width = max(width, rows_by_seq[seqs[i - 1]])
            rows = width * (seqs[j - 1] - seqs[i - 1] + 1)
            if rows > max_rows:
                break
            cost = best[i - 1] + pass_cost_rows + rows
            if cost <= best[j]:  # a tie: the wider last pass (each pass has some cost)
                best[j], cut[j] = cost, i - 1
    plans, j = [], n
    while j > 0:
        i = cut[j]
        members = seqs[i:j]
        width = max(rows_by_seq[s] for s in members)
        plans.append(PassPlan(members[0], members[-1], width, tuple(members)))
        j = i
    return plans[::-1]
