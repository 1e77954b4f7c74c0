"""Checks of a request against the model and the session: pure functions that raise the
error the client gets, before anything is touched."""

from __future__ import annotations

from collections.abc import Sequence

from server.shared.protocol import (
    SESSION_ID,
    SESSION_ID_HEADER,
    PrefillRequest,
    Strategy,
    VerifyRequest,
    strategy_for,
)
from server.verifier.errors import (
    APIError,
    ContextOverflow,
    DraftTooLong,
    InvalidDraftProbs,
    InvalidToken,
    NPastMismatch,
    SessionIdMismatch,
    UnsupportedSampling,
)

# How far a row of draft_probs may sum from 1 (the drafter sends float32-derived values).
PROBS_SUM_TOLERANCE = 1e-3


# What makes two /verify requests the same round: (n_past, draft_tokens, draft_probs,
# chunk_tokens, draft_accept).
RoundKey = tuple[
    int, tuple[int, ...], tuple[tuple[tuple[float, ...], ...], ...] | None, int, float | None
]


def round_key(request: VerifyRequest) -> RoundKey:
    """What makes two /verify requests the same round."""
    probs = None
    if request.draft_probs:  # an empty list says what no list says
        probs = tuple(tuple(map(tuple, row)) for row in request.draft_probs)
    chunk = request.chunk_tokens or 1
    return (request.n_past, tuple(request.draft_tokens), probs, chunk, request.draft_accept)


def resolve_strategy(request: PrefillRequest) -> Strategy:
    """The session's verification strategy: asked for, or the natural one."""
    greedy = request.sampling.greedy
    strategy = strategy_for(request.strategy, request.sampling)
    if strategy == "greedy" and not greedy:
        raise UnsupportedSampling("strategy 'greedy' needs temperature 0")
    if strategy != "greedy" and greedy:
        raise UnsupportedSampling(f"strategy '{strategy}' needs a temperature above 0")
    if strategy == "threshold" and request.threshold is None:
        raise UnsupportedSampling("strategy 'threshold' needs a threshold in (0, 1]")
    return strategy


def routing_header(values: Sequence[str]) -> str | None:
    """The X-Session-Id header's value; more than one is refused (balancers differ on
    which they hash)."""
    if len(values) > 1:
        raise SessionIdMismatch(f"{len(values)} {SESSION_ID_HEADER} headers; send one")
    return values[0] if values else None


def session_id_named(header: str | None, named: str | None) -> str | None:
    """The session a request names (body or path), which its X-Session-Id header, a
    balancer's routing key, must repeat; a /prefill naming none takes the header's."""
    if header is None or header == named:
        return named
    if named is not None:
        raise SessionIdMismatch(
            f"{SESSION_ID_HEADER} {header!r} names another session than the request's {named!r}"
        )
    if not SESSION_ID.fullmatch(header):
        raise SessionIdMismatch(f"{SESSION_ID_HEADER} {header!r} is not a valid session id")
    return header


def check_token_ids(ids: Sequence[int], n_vocab: int, where: str) -> None:
    for i, token in enumerate(ids):
        if not 0 <= token < n_vocab:
            raise InvalidToken(f"{where}[{i}] = {token} is outside [0, {n_vocab})")


def check_generated(n_prompt: int, generated: int) -> int:
    """The prompt's own length, the generated tokens at its end taken off (a reopened
    session's); at least one token of it stays a prompt."""
    if generated >= n_prompt:
        raise APIError(
            f"generated_tokens={generated}: the prompt has {n_prompt} tokens, and at least "
            "its first is not generated"
        )
    return n_prompt - generated


# Where an operator finds more context: the setting, and what it trades.
MORE_CONTEXT = (
    " (the verifier's VERIFIER_N_CTX; with it unset, fewer VERIFIER_MAX_SESSIONS or a "
    "larger VERIFIER_KV_CACHE_MB give each session more, up to the model's trained context)"
)


def check_prompt_len(n_tokens: int, n_ctx: int) -> None:
    if n_tokens >= n_ctx:
        raise ContextOverflow(
            f"the prompt has {n_tokens} tokens; a session's context holds {n_ctx} "
            f"and needs room for at least one new token{MORE_CONTEXT}"
        )


def check_round(
    committed: int,
    n_past: int,
    draft_tokens: Sequence[int],
    *,
    max_draft: int,
    n_ctx: int,
    n_vocab: int,
) -> None:
    """A round fits the session (`committed` tokens) and this verifier's limits."""
    if n_past != committed:
        raise NPastMismatch(
            f"n_past={n_past} but the session has {committed} committed tokens "
            f"(total_tokens={committed})",
            headers={"X-Total-Tokens": str(committed)},
        )
    if len(draft_tokens) > max_draft:
        raise DraftTooLong(
            f"the draft has {len(draft_tokens)} tokens; this verifier takes at most {max_draft}"
        )
    check_token_ids(draft_tokens, n_vocab, "draft_tokens")
    needed = committed + len(draft_tokens)
    if needed > n_ctx:
        raise ContextOverflow(
            f"the round needs {needed} positions; the session's context holds {n_ctx}{MORE_CONTEXT}"
        )


def check_verify(
    committed: int, request: VerifyRequest, max_draft: int, n_ctx: int, n_vocab: int
) -> None:
    """A round is the session's next (`committed` tokens), its draft well formed."""
    draft_tokens = list(request.draft_tokens)
    check_round(
        committed, request.n_past, draft_tokens, max_draft=max_draft, n_ctx=n_ctx, n_vocab=n_vocab
    )
    check_draft_probs(draft_tokens, request.draft_probs, n_vocab)


def check_draft_probs(
    draft_tokens: Sequence[int], pairs: list[list[tuple[int, float]]] | None, n_vocab: int
) -> None:
    """draft_probs, when present, is one distribution per draft token that could have
    produced it, whatever the session's strategy (only 'rejection' uses it; the others
    ignore a well-formed one)."""
    if pairs is None:
        return
    if len(pairs) != len(draft_tokens):
        raise InvalidDraftProbs(
            f"draft_probs has {len(pairs)} distributions for {len(draft_tokens)} tokens"
        )
    for i, (token, row) in enumerate(zip(draft_tokens, pairs, strict=True)):
        # Probabilities are already in [0, 1] and finite (the wire schema says so).
        mass = 0.0
        for token_id, prob in row:
            if not 0 <= token_id < n_vocab:
                raise InvalidToken(f"draft_probs[{i}] names token {token_id}")
            if token_id == token:
                mass += prob
        total = sum(prob for _, prob in row)
        if abs(total - 1.0) > PROBS_SUM_TOLERANCE:
            raise InvalidDraftProbs(f"draft_probs[{i}] sums to {total:.6f}, not 1")
        if mass <= 0.0:
            raise InvalidDraftProbs(
                f"draft token {token} at position {i} has no mass in draft_probs[{i}]"
            )
