"""What finishing a decoded round means: the strategy's rule judges the draft against the
verifier's logits (server/shared/acceptance.py), the rejected cells leave the session's
KV sequence, and the answer is recorded for a replay. The answer carries the draft length
the verifier advises next (server/verifier/decoding/advice.py), from the session's acceptance with
this round counted."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from server.shared.acceptance import judge
from server.shared.constraint import Constraint, GrammarError, TokenLimitReached
from server.shared.draft_gain import Acceptance
from server.shared.penalties import adjusted_rows, token_logprobs
from server.shared.protocol import RoundTimings, TokenLogprob, VerifyResponse
from server.verifier.decoding.checks import RoundKey
from server.verifier.decoding.jobs import VerifyWork
from server.verifier.errors import GrammarTokenLimit, InvalidGrammar, NonFiniteNumbers
from server.verifier.kv.sessions import Session

T = TypeVar("T")


def finish_round(
    work: VerifyWork,
    logits: np.ndarray,
    decode_s: float,
    *,
    remove: Callable[[int, int], None],
    is_eog: Callable[[int], bool],
    lossless: bool,
    advise: Callable[[Acceptance, int], int | None] | None = None,
    pass_sessions: float | None = None,
) -> VerifyResponse:
    """The round's answer, the session advanced by it. Everything that can fail comes
    before the session changes, so a round undone leaves no trace at all (its draws are
    its positions' own: the same again when it is sent again)."""
    session = work.session
    first = len(session.tokens) - session.prompt_len  # the round's first position
    undo_grammar: Callable[[], None] | None = None
    try:
        if not np.isfinite(logits).all():
            raise NonFiniteNumbers("the model's logits are not finite for this round")
        generated = session.tokens[session.prompt_len :]
        logits = adjusted_rows(logits, session.sampling, generated, work.draft_tokens)
        constraint = session.constraint
        if constraint is not None:
            masks = work.masks
            if masks is None:  # not computed beforehand (a step run by hand)
                masks = grammar_step(lambda: constraint.row_masks(work.draft_tokens))
            logits = constraint.apply_masks(logits, masks)
        target_tokens = [int(t) for t in np.argmax(logits, axis=1)]
        verdict = judge(
            session.strategy,
            work.draft_tokens,
            work.draft_probs,
            logits,
            target_tokens,
            session.sampling,
            session.threshold,
            lambda i: session.draws.at(first + i),
            is_eog,
        )
        # The grammar's state advanced before anything else changes (undone if a later
        # step fails): the KV trim below is the session's first change.
        undo_grammar = _committed(session.constraint, verdict.tokens)
        # A copy's outcome is the copies' own, and a client's lookup is no draft model's:
        # the session's acceptance judges a draft model's drafts. A lookup's rows fill a
        # pass as a model's do, so its length is the last draft the advice grows from.
        sent = 0 if work.copied else len(work.draft_tokens)
        drafted = 0 if work.lookup else sent
        acceptance = session.acceptance.after(drafted, verdict.accepted_prefix_len)
        copied = len(work.draft_tokens) if work.copied else 0
        resync = work.copied is not None and work.copied.resync  # judged apart (copy_draft.py)
        copies = session.copies.after(0 if resync else copied, verdict.accepted_prefix_len)
        resyncs = session.resyncs.after(copied if resync else 0, verdict.accepted_prefix_len)
        last_draft = sent or session.last_draft
        advised = advise(acceptance, last_draft) if advise is not None and work.advise else None
        # Keep the pending token and the accepted drafts; the target's own token
        # becomes the next pending token.
        remove(session.seq_id, work.start + verdict.accepted_prefix_len + 1)
        response = VerifyResponse(
            accepted_prefix_len=verdict.accepted_prefix_len,
            tokens=verdict.tokens,
            preds=target_tokens,
            total_tokens=len(session.tokens) + len(verdict.tokens),
            eos=verdict.eos,
            strategy=session.strategy,
            lossless=lossless,
            timings=RoundTimings(
                decode_ms=round(decode_s * 1000.0, 3),
                engine_ms=round((time.perf_counter() - work.began) * 1000.0, 3),
                decoded_tokens=len(work.tokens),
            ),
            advised_draft=advised,
            pass_sessions=pass_sessions,
            draft_verified=work.verified,
            logprobs=(
                None
                if session.logprobs is None
                else _logprobs(logits, verdict.tokens, session.logprobs)
            ),
        )
    except BaseException:
        if undo_grammar is not None:
            undo_grammar()
        raise
    session.tokens.extend(verdict.tokens)
    session.decoded_tokens += len(work.tokens)
    session.acceptance, session.copies, session.resyncs = acceptance, copies, resyncs
    session.last_draft = last_draft
    session.last_used = time.monotonic()
    session.last_round_key, session.last_response = work.round_key, response
    session.work, work.closed = None, True
    return response


def grammar_step(step: Callable[[], T]) -> T:
    """A grammar step; a grammar that fails there (a limit it reached) is the client's
    to hear of, as a 400, and so is a round past the session's token limit."""
    try:
        return step()
    except TokenLimitReached as exc:
        raise GrammarTokenLimit(str(exc)) from None
    except GrammarError as exc:
        raise InvalidGrammar(f"the grammar failed here: {exc}") from None


def bound_draft(work: VerifyWork) -> None:
    """The round's draft cut to the room its session's grammar bound leaves (a prefix of
    a draft is judged as the whole is, and the answer says what was verified); a round of
    a session at its bound is refused (400 grammar_token_limit)."""
    constraint = work.session.constraint
    if constraint is None or constraint.token_limit is None:
        return
    keep = grammar_step(lambda: constraint.draft_room(len(work.draft_tokens)))
    if keep < len(work.draft_tokens):
        work.cut(keep)


def _committed(constraint: Constraint | None, tokens: list[int]) -> Callable[[], None]:
    """The round's tokens consumed by the grammar (it undoes itself if that fails); what
    undoes them."""
    if constraint is None:
        return lambda: None
    return constraint.defer(tokens)


def _logprobs(logits: np.ndarray, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each committed token's, from the row it was chosen at (the i-th token at row i)."""
    out = []
    for row, token in zip(logits, tokens, strict=False):
        logprob, best = token_logprobs(row, token, top)
        out.append(TokenLogprob(token=token, logprob=logprob, top=best))
    return out


def record_answer(session: Session, key: RoundKey | None, response: VerifyResponse) -> None:
    """Record an answer made of several rounds (a chunk) as the one a replay of `key`
    gets, if the session is still where that answer left it."""
    if session.work is None and len(session.tokens) == response.total_tokens:
        session.last_round_key, session.last_response = key, response
