"""The verifier's sessions and rounds on top of one llama.cpp context.

Each session is one KV sequence (seq_id). Its committed tokens are `tokens`; all but the
last are in the KV cache, and the last one (the pending token) is evaluated at the start
of the next round together with the draft, so a round costs k+1 rows whatever the
context length.

A job's life is: `begin_prefill` / `begin_verify` (checks, a sequence reserved or the
session marked busy), then `run` (its rows shaped into passes, decoded, and the job
finished; on any failure exactly that job's cells and state undone), or `abandon` if it
will never run. Which jobs run together is the cycle step's choice (cycle.py); how they
are shaped into passes is passes.py's, within what the startup probe proved
(invariance.py).

Not thread-safe: one thread at a time drives it (scheduler.py holds the engine lock).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypedDict

import numpy as np

from server.shared import vocab
from server.shared.constraint import Constraint
from server.shared.info import InfoResponse
from server.shared.protocol import (
    LOSSLESS,
    MAX_CHUNK_TOKENS,
    PrefillRequest,
    PrefillResponse,
    Strategy,
    VerifyRequest,
    VerifyResponse,
)
from server.shared.runtime import DecodeError, LlamaRuntime
from server.shared.sampling import PositionDraws, dense
from server.verifier.decoding.advice import MAX_FIXED_ROWS, Advisor, PassCost
from server.verifier.decoding.checks import RoundKey, check_verify, resolve_strategy, round_key
from server.verifier.decoding.copy_draft import ChunkCopier
from server.verifier.decoding.decoder import PassDecoder, PassRecord
from server.verifier.decoding.decoding_rules import (
    decoding_rules,
    request_prompt_ids,
    verifier_grammars,
)
from server.verifier.decoding.jobs import JobRows, Opened, PrefillWork, VerifyWork, Work
from server.verifier.decoding.loading import Loaded
from server.verifier.decoding.retile import Retiler
from server.verifier.decoding.rounds import bound_draft, finish_round
from server.verifier.errors import (
    APIError,
    DecodeFailed,
    InternalError,
    InvalidDraftProbs,
    SessionBusy,
)
from server.verifier.kv.eviction import Eviction
from server.verifier.kv.packing import Packing
from server.verifier.kv.prefix_reuse import PrefixReuse
from server.verifier.kv.reply_spans import engine_cuts
from server.verifier.kv.sessions import Session, SessionTable
from server.verifier.probe.verdict_cache import probe_runtime
from server.verifier.settings import VerifierSettings

log = logging.getLogger(__name__)


# What `run` gives back for each job: its answer, None (a prompt not done yet), or the
# error it ended with (the job undone).
Result = Opened | VerifyResponse | APIError | None


@dataclass
class Ran:
    """What `run` did: one Result per job, rounds first, and the passes it decoded."""

    results: list[Result]
    passes: list[PassRecord]


class Engine:
    loaded: Loaded | None = None  # what sized and placed the runtime (loading.py), if known

    def __init__(self, runtime: LlamaRuntime, settings: VerifierSettings):
        """The runtime is probed here (invariance.py): the pass shapes, the prompt chunk
        and whether prefixes may be reused follow from what it finds."""
        max_draft = settings.max_draft
        widest = max(max_draft + 1, settings.pin_width or max_draft + 1)
        if runtime.n_batch < widest:
            raise ValueError(f"n_batch={runtime.n_batch} cannot hold a draft of {max_draft} + 1")
        self.runtime, self.max_draft = runtime, max_draft
        self.n_seq = runtime.n_seq_max
        self.n_ctx = min(settings.n_ctx or runtime.n_ctx_per_seq, runtime.n_ctx_per_seq - widest)
        if self.n_ctx < 2:
            raise ValueError("the context is too small for a prompt and a round")
        self.model_name = runtime.metadata("general.name") or runtime.model_path.stem
        # No text longer than this can fit: every token stands for at most its longest piece.
        longest_piece = max((len(piece) for piece in runtime.vocab_pieces()), default=1)
        self.max_prompt_chars = settings.max_prompt_chars or self.n_ctx * max(1, longest_piece)
        self.vocab = vocab.describe(runtime)
        self.decoder = PassDecoder(runtime)
        self._prefills: dict[int, PrefillWork] = {}  # seq id -> the prompt it is evaluating
        reuse = settings.prefix_cache_min_tokens if settings.prefix_cache else 0
        self.invariance, self.shapes = probe_runtime(runtime, self.decoder, settings, reuse > 0)
        report = self.invariance
        if reuse and not (report.batch_invariant and report.prefill_chunk_invariant):
            reuse = 0  # a prefix computed in other chunks would answer otherwise than a cold prompt
        self.prompt_chunk = report.prompt_chunk
        self.cuts = engine_cuts(runtime, report, settings)
        self.retiler = Retiler(self.cuts)
        # What a pass of rounds costs, learned from those it runs: the draft length advised.
        # Pinned, every pass computes every row of every sequence: rows are free there.
        # Unpinned, the probe's timed passes start the curve.
        prior = MAX_FIXED_ROWS if self.shapes.pinned_width else None
        if report.pass_s and not self.shapes.pinned_width:
            prior = self.shapes.pass_cost_rows
        self.pass_cost = PassCost(prior, report.pass_s)
        self.copier = ChunkCopier.of(settings, self.n_ctx, self.pass_cost)
        self.advisor = Advisor(self.pass_cost)
        self.grammars = verifier_grammars(runtime, settings)
        self.grammar_row_s = settings.grammar_row_ms / 1000.0
        self.sessions = SessionTable(
            self.n_seq,
            runtime.remove,
            copy=runtime.copy,
            packing=Packing(settings.pack_sessions),
            eviction=Eviction(self.n_seq, settings.key_share),
            prefix_reuse=PrefixReuse(reuse, self.cuts),
        )

    # -- facts ------------------------------------------------------------------------

    def lossless(self, strategy: Strategy) -> bool:
        """Greedy is token for token the verifier's own only where the probe found every
        pass shape exact."""
        if strategy == Strategy.greedy:
            return self.invariance.batch_invariant
        return LOSSLESS[strategy]

    prefix_cache = property(lambda self: self.sessions.prefix_reuse.min_tokens > 0)
    session_count = property(lambda self: len(self.sessions))

    def session(self, session_id: str, owner: str | None = None) -> Session:
        return self.sessions.get(session_id, owner)

    # These read the vocabulary only, never a session: safe on any thread (the text pool).
    def tokenize(self, text: str, add_special: bool) -> list[int]:
        return self.runtime.tokenize(text, add_special=add_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.runtime.detokenize(tokens)

    # -- beginning work ---------------------------------------------------------------

    def begin_prefill(
        self, request: PrefillRequest, keep: Iterable[str] = (), owner: str = "anonymous",
        constraint: Constraint | None = None,
    ) -> PrefillWork:  # fmt: skip
        """Validate and reserve a KV sequence; sessions in `keep` (work queued) are never
        evicted to make room. `constraint`: the grammar's state, compiled already."""
        strategy = resolve_strategy(request)
        prompt_ids = request_prompt_ids(self.runtime, request, self.n_ctx)
        prompt_len, constraint = decoding_rules(request, prompt_ids, self.grammars, constraint)
        session_id = request.session_id or uuid.uuid4().hex
        self.sessions.check_new_id(session_id)  # before anything is evicted for it
        # A reopened session's generated tokens go below the tile, as its rounds did.
        tiling = self.cuts.tiling(prompt_ids, prompt_len)
        scope = request.cache_scope or ""  # a proxy's client's, within the key
        reservation = self.sessions.reserve(session_id, owner, prompt_ids, keep, tiling, scope)
        session = Session(
            session_id=session_id,
            seq_id=reservation.seq_id,
            tokens=list(prompt_ids),
            prompt_len=prompt_len,
            sampling=request.sampling,
            strategy=strategy,
            threshold=request.threshold,
            draws=PositionDraws.seeded(request.sampling.seed),
            owner=owner,
            cache_scope=scope,
            logprobs=request.logprobs,
            constraint=constraint,  # the grammar's state (compiled once per grammar)
            tiling=tiling,
        )
        work = PrefillWork(session, prompt_ids[:-1], reservation, tiling)
        self._prefills[session.seq_id] = work
        return work

    def begin_verify(
        self, request: VerifyRequest, owner: str | None = None, key: RoundKey | None = None
    ) -> VerifyWork | VerifyResponse:
        """The round's work, or a replay's recorded answer (`key`: its round_key, if known)."""
        began = time.perf_counter()  # engine_ms counts the checks too
        session = self.session(request.session_id, owner)
        key = key or round_key(request)
        if session.last_round_key == key and session.last_response is not None:
            return session.last_response
        if session.work is not None:
            raise SessionBusy(f"session {request.session_id!r} has a round in progress")
        self.check_round(session, request)
        draft_tokens, n_vocab = list(request.draft_tokens), self.runtime.n_vocab
        draft_probs = None
        if session.strategy == Strategy.rejection and draft_tokens and request.draft_probs:
            draft_probs = [(q := dense(row, n_vocab)) / q.sum() for row in request.draft_probs]
        work = VerifyWork(session, draft_tokens, draft_probs, session.n_cached, key, began)
        work.lookup = request.draft_kind == "lookup"
        bound_draft(work)  # before the session holds it: a refusal leaves nothing to undo
        session.work = work
        return work

    def check_round(self, session: Session, request: VerifyRequest) -> None:
        """What makes a round the session's next one, and its draft well formed."""
        check_verify(len(session.tokens), request, self.max_draft, self.n_ctx, self.runtime.n_vocab)
        rejection = session.strategy == Strategy.rejection
        if rejection and request.draft_tokens and request.draft_probs is None:
            raise InvalidDraftProbs(
                "strategy 'rejection' needs draft_probs (the drafter's q per draft token); "
                "use strategy 'match' to send tokens only"
            )

    # -- running work -----------------------------------------------------------------

    def run(
        self, rounds: Sequence[VerifyWork], prompts: Sequence[PrefillWork] = (),
        interleaved: bool = False,
    ) -> Ran:  # fmt: skip
        """Decode the rounds and the next chunk of each prompt, shaped into passes; each
        job finished or undone. `interleaved`: rounds wait for the prompts' turn to end."""
        jobs = [JobRows(w.session.seq_id, w.start, w.tokens, True) for w in rounds]
        jobs += [work.next_rows(self.cuts, interleaved) for work in prompts]
        works: list[Work] = [*rounds, *prompts]
        decoded = self.decoder.decode(jobs, self.shapes, tolerate=True)
        for record in decoded.passes:
            if record.kind == "rounds":
                self.pass_cost.observe(record.rows, record.seconds, record.sessions)
        results: list[Result] = []
        for work, job, outcome, seconds in zip(
            works, jobs, decoded.outcomes, decoded.seconds, strict=True
        ):
            try:
                if isinstance(outcome, Exception):
                    raise outcome
                if isinstance(work, VerifyWork):
                    results.append(self._finish_verify(work, outcome, seconds))
                else:
                    results.append(self._advance_prefill(work, len(job.tokens)))
            except Exception as exc:
                results.append(self._fail(work, exc))
        # Counted once the pass's rounds are answered, each in its owner's pool (lookups too).
        for work, out in zip(works, results, strict=True):
            if isinstance(work, VerifyWork) and isinstance(out, VerifyResponse) and not work.copied:
                owner, drafted = work.session.owner, len(work.draft_tokens)
                self.advisor.count(owner, drafted, out.accepted_prefix_len)
        return Ran(results, decoded.passes)

    def retile(self) -> int:
        """Idle work, a piece at a time (retile.py); the tokens evaluated, 0: none to do."""
        return self.retiler.step(self.sessions, self.runtime, self.decoder, self.shapes)

    def abandon(self, work: Work) -> None:
        """Undo a begun job that will never run (the cycle failed it or it is stopping)."""
        if not work.closed:
            self._fail(work, InternalError("abandoned"))

    def close(self) -> None:
        self.sessions.release_all()
        self.runtime.close()

    # -- internals --------------------------------------------------------------------

    def _finish_verify(self, work: VerifyWork, logits: np.ndarray, spent: float) -> VerifyResponse:
        return finish_round(
            work,
            logits,
            spent,
            remove=self.runtime.remove,
            is_eog=self.runtime.is_eog,
            lossless=self.lossless(work.session.strategy),
            advise=lambda a, last: self.advisor.advise(a, self.max_draft, last, work.session.owner),
            pass_sessions=round(self.pass_cost.sharing, 2),
        )

    def _advance_prefill(self, work: PrefillWork, n_tokens: int) -> Opened | None:
        """Count a decoded chunk; the session opened once the whole prompt is cached."""
        work.evaluated += n_tokens
        work.session.decoded_tokens += n_tokens
        if work.remaining > 0:
            return None
        session = work.session
        del self._prefills[session.seq_id]
        self.sessions.activate(session)
        work.closed = True
        response = PrefillResponse(
            session_id=session.session_id,
            prompt_ids=list(session.tokens),
            prompt_len=len(session.tokens),  # evaluated (a reopened session's output too)
            total_tokens=len(session.tokens),
            strategy=session.strategy,
            lossless=self.lossless(session.strategy),
            cached_tokens=work.reservation.reused,
            advised_draft=self.advisor.advise(
                session.acceptance, self.max_draft, session.last_draft, session.owner
            ),
        )
        return Opened(response, session, work.reservation)

    def _fail(self, work: Work, exc: BaseException) -> APIError:
        """Undo a job: a round leaves its session as before it; a prompt frees its sequence.
        A session whose cells cannot be removed is ended rather than left inconsistent."""
        work.closed = True
        session = work.session
        if isinstance(work, VerifyWork):
            session.work = None
            try:
                self.runtime.remove(session.seq_id, work.start)
            except Exception:
                log.exception("could not remove the cells of a failed round")
                self.sessions.discard(session.session_id, keep_prefix=False)
        else:
            self._prefills.pop(session.seq_id, None)
            try:
                self.sessions.unreserve(session.seq_id)
            except Exception:  # the sequence is free again; the next reserve empties it
                log.exception("could not empty the sequence of a failed prompt")
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, DecodeError):
            return DecodeFailed(f"decode failed: {exc}")
        log.error("engine error", exc_info=exc)
        return InternalError(f"{type(exc).__name__}: {exc}")


def engine_info(engine: Engine) -> InfoResponse:
    """GET /info: the model, the session limits and what the startup probe found."""
    rt, report, shapes = engine.runtime, engine.invariance, engine.shapes
    return InfoResponse(
        model=engine.model_name,
        model_path=str(rt.model_path),
        quantization=rt.quantization,
        n_ctx=engine.n_ctx,
        **InfoResponse.vocabulary_fields(engine.vocab),  # flat on the wire, as ever
        max_draft=engine.max_draft,
        max_chunk_tokens=MAX_CHUNK_TOKENS,
        max_sessions=engine.n_seq,
        flash_attn=rt.flash_attn,
        batch_invariant=report.batch_invariant,
        batch_max_diff=report.max_abs_diff,
        pinned_width=report.pinned_width,
        pinned_logits=report.pinned_logits,
        max_pass_rows=shapes.max_rows,
        pass_cost_rows=round(shapes.pass_cost_rows, 2),
        prefill_chunk_invariant=report.prefill_chunk_invariant,
        prefill_chunk_max_diff=report.prefill_chunk_max_diff,
        prompt_chunk=engine.prompt_chunk,
        prompt_tile_rows=engine.cuts.tile_rows,
        prompt_pad=engine.cuts.pad,
        prefix_cache=engine.prefix_cache,
        lookup_drafts=True,
        cache_scopes=True,
        lookup_sizing=engine.copier.sizing,
        chunk_copy_ngram=engine.copier.ngram,
        strategies={s: engine.lossless(s) for s in LOSSLESS},
        **placement_info(engine.loaded),
    )


class PlacementInfo(TypedDict, total=False):  # InfoResponse's fields of where it computes
    n_ctx_train: int
    context_source: str
    backend: str
    device: str
    gpu_layers: int
    n_layer: int


def placement_info(loaded: Loaded | None) -> PlacementInfo:
    """/info's facts of where the model computes and what sized its context."""
    if loaded is None:
        return {}
    where = loaded.placement
    return {
        "n_ctx_train": loaded.runtime.n_ctx_train,
        "context_source": loaded.context.source,
        "backend": where.backend,
        "device": where.device,
        "gpu_layers": where.gpu_layers,
        "n_layer": where.n_layer,
    }
