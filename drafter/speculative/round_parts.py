"""What a round of the loop (drafter/speculative/loop.py) sends and leaves behind: its /verify
request, what it cost (as the draft length learns from it), and its counts."""

from __future__ import annotations

from drafter.speculative.candidates import Draft, RoundTiming
from drafter.speculative.stats import GenerationStats
from server.shared.protocol import VerifyRequest, VerifyResponse
from server.shared.sampling import sparse


def count_round(
    stats: GenerationStats,
    draft: Draft,
    verdict: VerifyResponse,
    timing: RoundTiming,
    generated: int,
    lookup: bool,
) -> None:
    """The round in the generation's counts (`lookup`: a lookup's draft where a model
    drafts beside it)."""
    drafted, accepted = len(draft.tokens), verdict.accepted_prefix_len
    stats.count_round(drafted, accepted, draft.reused, len(verdict.tokens))
    if lookup:
        stats.count_lookup(drafted, accepted)
    stats.round_trip_s += timing.round_trip_s
    stats.verifier_time_s += timing.verifier_s
    stats.generated_tokens = generated


def round_timing(
    draft: Draft, verdict: VerifyResponse, draft_s: float, round_trip_s: float
) -> RoundTiming:
    """What a round cost, as the draft length learns from it."""
    return RoundTiming(
        rows=len(draft.tokens) + 1,
        verifier_s=verdict.timings.engine_ms / 1000.0,
        round_trip_s=round_trip_s,
        draft_s=draft_s,
        drafted_ahead=draft.reused == len(draft.tokens) > 0,
        steps=1 if draft.tokens else max(1, len(verdict.tokens)),
        tokens=len(verdict.tokens),
    )


def verify_request(
    session_id: str, committed: list[int], draft: Draft, chunk: int, mark_lookups: bool = True
) -> VerifyRequest:
    """The round as /verify takes it: the draft (and its q where sampled; a lookup's
    marked as one, where `mark_lookups`: a verifier that predates the mark refuses it,
    with its acceptance where it has one, for the verifier to size), or a chunk."""
    lookup = mark_lookups and draft.lookup and bool(draft.tokens)
    return VerifyRequest(
        session_id=session_id,
        n_past=len(committed),
        draft_tokens=list(draft.tokens),
        draft_probs=None if draft.probs is None else [sparse(q) for q in draft.probs],
        chunk_tokens=chunk if chunk > 1 else None,
        draft_kind="lookup" if lookup else None,
        draft_accept=draft.accept if lookup else None,
    )
