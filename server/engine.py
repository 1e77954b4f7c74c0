"""The verifier's sessions and rounds on top of one llama.cpp context.

Each session is one KV sequence (seq_id). Its committed tokens are `tokens`; all but the
last are in the KV cache, and the last one (the pending token) is evaluated at the start
of the next round together with the draft, so a round costs one decode of k+1 tokens
whatever the context length.

Not thread-safe: the app calls it from a single worker thread (server/worker.py).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from server.acceptance import accept_greedy
from server.errors import (
    ContextOverflow,
    DraftTooLong,
    EngineFailure,
    InvalidToken,
    NPastMismatch,
    SessionNotFound,
    UnsupportedSampling,
)
from server.protocol import (
    InfoResponse,
    PrefillRequest,
    PrefillResponse,
    PromptInput,
    RoundTimings,
    SamplingParams,
    VerifyRequest,
    VerifyResponse,
    vocab_fingerprint,
)
from server.runtime import BatchEntry, DecodeError, LlamaRuntime

log = logging.getLogger(__name__)


@dataclass
class Session:
    session_id: str
    seq_id: int
    tokens: list[int]  # committed tokens, prompt included; tokens[-1] is not yet in the KV cache
    prompt_len: int
    sampling: SamplingParams
    last_used: float = field(default_factory=time.monotonic)
    decoded_tokens: int = 0  # everything this session has evaluated, prompt included

    @property
    def n_cached(self) -> int:
        return len(self.tokens) - 1


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

    def session(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
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

    def prefill(self, request: PrefillRequest) -> PrefillResponse:
        if not request.sampling.greedy:
            raise UnsupportedSampling("this verifier only does greedy decoding (temperature 0)")
        prompt_ids = self.prompt_ids(request)
        seq_id = self._take_seq_id()
        session = Session(
            session_id=uuid.uuid4().hex,
            seq_id=seq_id,
            tokens=list(prompt_ids),
            prompt_len=len(prompt_ids),
            sampling=request.sampling,
        )
        try:
            self.runtime.clear(seq_id)
            self.runtime.decode_sequence(seq_id, prompt_ids[:-1], 0, logits="none")
        except DecodeError as exc:
            self.runtime.clear(seq_id)
            self._free_seq_ids.append(seq_id)
            raise EngineFailure(f"prefill failed: {exc}") from exc
        session.decoded_tokens = len(prompt_ids) - 1
        self._sessions[session.session_id] = session
        return PrefillResponse(
            session_id=session.session_id,
            prompt_ids=prompt_ids,
            prompt_len=len(prompt_ids),
            total_tokens=len(session.tokens),
        )

    def verify(self, request: VerifyRequest) -> VerifyResponse:
        session = self.session(request.session_id)
        draft_tokens = list(request.draft_tokens)
        self._check_round(session, request.n_past, draft_tokens)
        if request.draft_probs is not None and len(request.draft_probs) != len(draft_tokens):
            raise InvalidToken("draft_probs needs one distribution per draft token")

        start = session.n_cached
        batch_tokens = [session.tokens[-1], *draft_tokens]
        entries = [
            BatchEntry(token=t, pos=start + i, seq_id=session.seq_id, want_logits=True)
            for i, t in enumerate(batch_tokens)
        ]
        began = time.perf_counter()
        try:
            logits = self.runtime.decode(entries)
        except DecodeError as exc:
            self.runtime.remove(session.seq_id, start)
            raise EngineFailure(f"verify failed: {exc}") from exc
        decode_ms = (time.perf_counter() - began) * 1000.0
        session.decoded_tokens += len(entries)

        target_tokens = [int(t) for t in np.argmax(logits, axis=1)]
        verdict = accept_greedy(draft_tokens, target_tokens, self.runtime.is_eog)
        # Keep the pending token and the accepted drafts; the target's own token becomes
        # the next pending token.
        self.runtime.remove(session.seq_id, start + verdict.accepted_prefix_len + 1)
        session.tokens.extend(verdict.tokens)
        return VerifyResponse(
            accepted_prefix_len=verdict.accepted_prefix_len,
            tokens=verdict.tokens,
            preds=target_tokens,
            total_tokens=len(session.tokens),
            eos=verdict.eos,
            timings=RoundTimings(decode_ms=round(decode_ms, 3), decoded_tokens=len(entries)),
        )

    def delete_session(self, session_id: str) -> None:
        session = self.session(session_id)
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
                f"(total_tokens={committed})"
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

    def _take_seq_id(self) -> int:
        if not self._free_seq_ids:
            _, oldest = next(iter(self._sessions.items()))
            log.info("evicting least recently used session %s", oldest.session_id)
            self._release(oldest)
        return self._free_seq_ids.pop()

    def _release(self, session: Session) -> None:
        self._sessions.pop(session.session_id, None)
        self.runtime.clear(session.seq_id)
        self._free_seq_ids.append(session.seq_id)
