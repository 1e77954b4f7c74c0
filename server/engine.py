"""The verifier's sessions and rounds on top of one llama.cpp context.

Each session is one KV sequence (seq_id). Its committed tokens are `tokens`; all but the
last are in the KV cache, and the last one (the pending token) is evaluated at the start
of the next round together with the draft, so a round costs one decode of k+1 tokens
whatever the context length.

Not thread-safe: the app calls it only under the batch scheduler's engine lock
(server/scheduler.py), from its thread or, for a lone round, from the event loop.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from server.acceptance import (
    Verdict,
    accept_greedy,
    accept_match,
    accept_rejection,
    accept_threshold,
)
from server.errors import (
    ContextOverflow,
    DraftTooLong,
    InvalidDraftProbs,
    InvalidToken,
    NPastMismatch,
    ServerFull,
    SessionNotFound,
    UnsupportedSampling,
)
from server.protocol import (
    LOSSLESS,
    InfoResponse,
    PrefillRequest,
    PrefillResponse,
    PromptInput,
    RoundTimings,
    SamplingParams,
    Strategy,
    VerifyRequest,
    VerifyResponse,
    vocab_fingerprint,
)
from server.runtime import BatchEntry, LlamaRuntime
from server.sampling import dense, probabilities

log = logging.getLogger(__name__)


@dataclass
class Session:
    session_id: str
    seq_id: int
    tokens: list[int]  # committed tokens, prompt included; tokens[-1] is not yet in the KV cache
    prompt_len: int
    sampling: SamplingParams
    strategy: Strategy
    threshold: float | None
    rng: np.random.Generator  # the session's own stream: a seed makes it reproducible
    owner: str = "anonymous"  # the API key identity that opened it
    last_used: float = field(default_factory=time.monotonic)
    # The last round's request and answer: a replay of it (a client that lost the
    # response) gets the same answer and changes nothing.
    last_round_key: tuple | None = None
    last_response: VerifyResponse | None = None
    decoded_tokens: int = 0  # everything this session has evaluated, prompt included

    @property
    def n_cached(self) -> int:
        return len(self.tokens) - 1


@dataclass
class PrefillWork:
    session: Session
    to_evaluate: list[int]  # the prompt but its last token (that one is the pending token)
    evaluated: int = 0

    @property
    def done(self) -> bool:
        return self.evaluated >= len(self.to_evaluate)


@dataclass
class VerifyWork:
    session: Session
    draft_tokens: list[int]
    draft_probs: list[np.ndarray] | None
    start: int  # position of the pending token
    entries: list[BatchEntry]
    round_key: tuple
    began: float = field(default_factory=time.perf_counter)


def _round_key(request: VerifyRequest) -> tuple:
    probs = None
    if request.draft_probs is not None:
        probs = tuple(tuple(map(tuple, row)) for row in request.draft_probs)
    return (request.n_past, tuple(request.draft_tokens), probs)


def resolve_strategy(request: PrefillRequest) -> Strategy:
    """The session's verification strategy: asked for, or the natural one."""
    greedy = request.sampling.greedy
    strategy = request.strategy or ("greedy" if greedy else "rejection")
    if strategy == "greedy" and not greedy:
        raise UnsupportedSampling("strategy 'greedy' needs temperature 0")
    if strategy != "greedy" and greedy:
        raise UnsupportedSampling(f"strategy '{strategy}' needs a temperature above 0")
    if strategy == "threshold" and request.threshold is None:
        raise UnsupportedSampling("strategy 'threshold' needs a threshold in (0, 1]")
    return strategy


class Engine:
    def __init__(self, runtime: LlamaRuntime, *, max_draft: int, model_name: str | None = None):
        if runtime.n_batch < max_draft + 1:
            raise ValueError(f"n_batch={runtime.n_batch} cannot hold a draft of {max_draft} + 1")
        self.runtime = runtime
        self.max_draft = max_draft
        self.max_sessions = runtime.n_seq_max
        self.n_ctx = runtime.n_ctx_per_seq
        self.model_name = model_name or runtime.metadata("general.name") or runtime.model_path.stem
        self.vocab_hash = vocab_fingerprint(runtime.vocab_pieces())
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._free_seq_ids = list(range(self.max_sessions - 1, -1, -1))
        self.evicted_sessions = 0

    # -- facts ------------------------------------------------------------------------

    def info(self) -> InfoResponse:
        rt = self.runtime
        return InfoResponse(
            model=self.model_name,
            model_path=str(rt.model_path),
            quantization=rt.quantization,
            n_vocab=rt.n_vocab,
            n_ctx=self.n_ctx,
            bos_id=rt.bos_id,
            eos_id=rt.eos_id,
            add_bos=rt.add_bos,
            vocab_hash=self.vocab_hash,
            max_draft=self.max_draft,
            max_sessions=self.max_sessions,
            flash_attn=rt.flash_attn,
        )

    @property
    def session_count(self) -> int:
        return len(self._sessions)

    def session(self, session_id: str, owner: str | None = None) -> Session:
        session = self._sessions.get(session_id)
        # Another key's session answers exactly like a missing one: no probing for ids.
        if session is None or (owner is not None and session.owner != owner):
            raise SessionNotFound(f"no session {session_id!r} (it ended, expired or was evicted)")
        self._sessions.move_to_end(session_id)
        session.last_used = time.monotonic()
        return session

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.runtime.detokenize(tokens)

    # -- requests ---------------------------------------------------------------------

    def prompt_ids(self, request: PromptInput) -> list[int]:
        if request.prompt is not None:
            ids = self.runtime.tokenize(request.prompt, add_special=request.add_bos)
        else:
            ids = list(request.prompt_tokens or [])
            self._check_token_ids(ids, "prompt_tokens")
        if not ids:
            raise ContextOverflow("the prompt is empty: give some text or add_bos=true")
        if len(ids) >= self.n_ctx:
            raise ContextOverflow(
                f"the prompt has {len(ids)} tokens; a session's context holds {self.n_ctx} "
                "and needs room for at least one new token"
            )
        return ids

    # -- prefill, in chunks the scheduler interleaves with other sessions' rounds --------

    def begin_prefill(
        self, request: PrefillRequest, busy: set[str], owner: str = "anonymous"
    ) -> PrefillWork:
        """Validate and reserve a KV sequence; `busy` sessions (work queued) are never
        evicted to make room."""
        strategy = resolve_strategy(request)
        prompt_ids = self.prompt_ids(request)
        seq_id = self._take_seq_id(busy)
        self.runtime.clear(seq_id)
        session = Session(
            session_id=uuid.uuid4().hex,
            seq_id=seq_id,
            tokens=list(prompt_ids),
            prompt_len=len(prompt_ids),
            sampling=request.sampling,
            strategy=strategy,
            threshold=request.threshold,
            rng=np.random.default_rng(request.sampling.seed),
            owner=owner,
        )
        return PrefillWork(session=session, to_evaluate=prompt_ids[:-1])

    def prefill_entries(self, work: PrefillWork, budget: int) -> list[BatchEntry]:
        chunk = work.to_evaluate[work.evaluated : work.evaluated + budget]
        return [
            BatchEntry(
                token=t, pos=work.evaluated + i, seq_id=work.session.seq_id, want_logits=False
            )
            for i, t in enumerate(chunk)
        ]

    def advance_prefill(self, work: PrefillWork, n_evaluated: int) -> PrefillResponse | None:
        """Count a decoded chunk; the response once the whole prompt is in the cache."""
        work.evaluated += n_evaluated
        work.session.decoded_tokens += n_evaluated
        if not work.done:
            return None
        session = work.session
        self._sessions[session.session_id] = session
        return PrefillResponse(
            session_id=session.session_id,
            prompt_ids=list(session.tokens),
            prompt_len=session.prompt_len,
            total_tokens=len(session.tokens),
            strategy=session.strategy,
            lossless=LOSSLESS[session.strategy],
        )

    def abort_prefill(self, work: PrefillWork) -> None:
        self.runtime.clear(work.session.seq_id)
        self._free_seq_ids.append(work.session.seq_id)

    # -- verify rounds ----------------------------------------------------------------

    def begin_verify(
        self, request: VerifyRequest, owner: str | None = None
    ) -> VerifyWork | VerifyResponse:
        """The round's work, or, for a replay of the last round, its recorded answer."""
        began = time.perf_counter()  # engine_ms counts the checks too
        session = self.session(request.session_id, owner)
        round_key = _round_key(request)
        if session.last_round_key == round_key and session.last_response:
            return session.last_response
        draft_tokens = list(request.draft_tokens)
        self._check_round(session, request.n_past, draft_tokens)
        draft_probs = None
        if session.strategy == "rejection" and draft_tokens:
            draft_probs = self._dense_draft_probs(draft_tokens, request.draft_probs)
        start = session.n_cached
        entries = [
            BatchEntry(token=t, pos=start + i, seq_id=session.seq_id, want_logits=True)
            for i, t in enumerate([session.tokens[-1], *draft_tokens])
        ]
        return VerifyWork(session, draft_tokens, draft_probs, start, entries, round_key, began)

    def finish_verify(
        self, work: VerifyWork, logits: np.ndarray, decode_ms: float
    ) -> VerifyResponse:
        session = work.session
        session.decoded_tokens += len(work.entries)
        target_tokens = [int(t) for t in np.argmax(logits, axis=1)]
        verdict = self._judge(session, work.draft_tokens, work.draft_probs, logits, target_tokens)
        # Keep the pending token and the accepted drafts; the target's own token becomes
        # the next pending token.
        self.runtime.remove(session.seq_id, work.start + verdict.accepted_prefix_len + 1)
        session.tokens.extend(verdict.tokens)
        session.last_used = time.monotonic()
        response = VerifyResponse(
            accepted_prefix_len=verdict.accepted_prefix_len,
            tokens=verdict.tokens,
            preds=target_tokens,
            total_tokens=len(session.tokens),
            eos=verdict.eos,
            strategy=session.strategy,
            lossless=LOSSLESS[session.strategy],
            timings=RoundTimings(
                decode_ms=round(decode_ms, 3),
                engine_ms=round((time.perf_counter() - work.began) * 1000.0, 3),
                decoded_tokens=len(work.entries),
            ),
        )
        session.last_round_key, session.last_response = work.round_key, response
        return response

    def abort_verify(self, work: VerifyWork) -> None:
        """Undo a round whose decode failed: the session is exactly as before."""
        self.runtime.remove(work.session.seq_id, work.start)

    def expire_idle(self, ttl_s: float, busy: set[str]) -> list[str]:
        """End sessions unused for `ttl_s` seconds; returns their ids."""
        now = time.monotonic()
        expired = [
            s
            for s in self._sessions.values()
            if now - s.last_used > ttl_s and s.session_id not in busy
        ]
        for session in expired:
            self._release(session)
        return [s.session_id for s in expired]

    def delete_session(self, session_id: str, owner: str | None = None) -> None:
        session = self.session(session_id, owner)
        self._release(session)

    def discard_session(self, session_id: str) -> None:
        """Free a session if it still exists (cleanup paths, where eviction may have won)."""
        session = self._sessions.get(session_id)
        if session is not None:
            self._release(session)

    def close(self) -> None:
        for session in list(self._sessions.values()):
            self._release(session)
        self.runtime.close()

    # -- internals --------------------------------------------------------------------

    def _judge(
        self,
        session: Session,
        draft_tokens: list[int],
        draft_probs: list[np.ndarray] | None,
        logits: np.ndarray,
        target_tokens: list[int],
    ) -> Verdict:
        is_eog = self.runtime.is_eog
        if session.strategy == "greedy":
            return accept_greedy(draft_tokens, target_tokens, is_eog)
        target_probs = np.stack([probabilities(row, session.sampling) for row in logits])
        if session.strategy == "rejection":
            if not draft_tokens:
                return accept_match([], target_probs, session.rng, is_eog)
            return accept_rejection(draft_tokens, draft_probs, target_probs, session.rng, is_eog)
        if session.strategy == "match":
            return accept_match(draft_tokens, target_probs, session.rng, is_eog)
        return accept_threshold(draft_tokens, target_probs, session.threshold, session.rng, is_eog)

    def _dense_draft_probs(
        self, draft_tokens: list[int], pairs: list[list[tuple[int, float]]] | None
    ) -> list[np.ndarray]:
        """The drafter's q per position as dense rows, refused unless it is a distribution
        that could have produced the draft token."""
        if pairs is None:
            raise InvalidDraftProbs(
                "strategy 'rejection' needs draft_probs (the drafter's q per draft token); "
                "use strategy 'match' to send tokens only"
            )
        if len(pairs) != len(draft_tokens):
            raise InvalidDraftProbs(
                f"draft_probs has {len(pairs)} distributions for {len(draft_tokens)} tokens"
            )
        n_vocab = self.runtime.n_vocab
        rows = []
        for i, (token, row) in enumerate(zip(draft_tokens, pairs, strict=True)):
            # Probabilities are already in [0, 1] and finite (the wire schema says so).
            for token_id, _ in row:
                if not 0 <= token_id < n_vocab:
                    raise InvalidToken(f"draft_probs[{i}] names token {token_id}")
            q = dense(row, n_vocab)
            total = q.sum()
            if abs(total - 1.0) > 1e-3:
                raise InvalidDraftProbs(f"draft_probs[{i}] sums to {total:.6f}, not 1")
            if q[token] <= 0.0:
                raise InvalidDraftProbs(
                    f"draft token {token} at position {i} has no mass in draft_probs[{i}]"
                )
            rows.append(q / total)
        return rows

    def _check_token_ids(self, ids: Sequence[int], where: str) -> None:
        n_vocab = self.runtime.n_vocab
        for i, token in enumerate(ids):
            if not 0 <= token < n_vocab:
                raise InvalidToken(f"{where}[{i}] = {token} is outside [0, {n_vocab})")

    def _check_round(self, session: Session, n_past: int, draft_tokens: list[int]) -> None:
        committed = len(session.tokens)
        if n_past != committed:
            raise NPastMismatch(
                f"n_past={n_past} but the session has {committed} committed tokens "
                f"(total_tokens={committed})",
                headers={"X-Total-Tokens": str(committed)},
            )
        if len(draft_tokens) > self.max_draft:
            raise DraftTooLong(
                f"the draft has {len(draft_tokens)} tokens; this verifier takes at most "
                f"{self.max_draft}"
            )
        self._check_token_ids(draft_tokens, "draft_tokens")
        needed = committed + len(draft_tokens)
        if needed > self.n_ctx:
            raise ContextOverflow(
                f"the round needs {needed} positions; the session's context holds {self.n_ctx}"
            )

    def _take_seq_id(self, busy: set[str]) -> int:
        if not self._free_seq_ids:
            # Least recently used first; a session with work queued is never the victim.
            victim = next((s for s in self._sessions.values() if s.session_id not in busy), None)
            if victim is None:
                raise ServerFull(
                    f"all {self.max_sessions} sessions have work in progress; retry shortly"
                )
            log.info("evicting least recently used session %s", victim.session_id)
            self.evicted_sessions += 1
            self._release(victim)
        return self._free_seq_ids.pop()

    def _release(self, session: Session) -> None:
        self._sessions.pop(session.session_id, None)
        self.runtime.clear(session.seq_id)
        self._free_seq_ids.append(session.seq_id)
