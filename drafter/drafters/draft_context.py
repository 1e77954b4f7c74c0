"""The draft model's llama.cpp context, shared by the sequences of concurrent generations.

`serve --parallel N` gives each generation its own KV sequence in one context. Threads
that want a decode while another decode runs queue up, and the next decode takes all of
them that fit in one batch (group commit): drafts of concurrent requests that line up
share a `llama_decode`, and no thread ever waits on a timer for batch-mates. Decoding is
server/shared/batching.py's, as the verifier's is.

A request may ask to be decoded alone: its logits then never depend on what others are
doing (the Q4_K kernels are not batch-invariant), which seeded sampling needs. A long one
(a prompt) goes n_batch tokens at a time, back in the queue between chunks, so one long
prompt does not hold up the other generations' drafts. A shared decode that fails is
retried request by request, so only the request at fault fails.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from drafter.errors import DraftModelError
from server.shared.batching import (
    Piece,
    chunk_len,
    decode_pieces,
    forget,
    together_or_alone,
)
from server.shared.machine import usable_cores
from server.shared.runtime import LlamaRuntime

if TYPE_CHECKING:
    from server.shared.grammars import Grammars

# Tokens of one request beyond which it is decoded on its own (a prompt, not a draft step).
MAX_SHARED_TOKENS = 32


@dataclass(eq=False)
class _Decode:
    seq_id: int
    tokens: Sequence[int]
    start: int
    alone: bool
    evaluated: int = 0  # tokens decoded so far: a long one goes n_batch at a time
    logits: np.ndarray | None = None
    error: Exception | None = None
    done: bool = False


class DraftContext:
    def __init__(self, runtime: LlamaRuntime):
        self.runtime = runtime
        self.n_seq = runtime.n_seq_max
        self._cond = threading.Condition()
        self._queue: deque[_Decode] = deque()
        self._busy = False  # a thread is in llama.cpp with this context
        self._closed = False
        self.decodes = 0  # llama_decode calls made for draft sequences
        # The verifier's vocabulary size where it differs from ours (a compatible pair,
        # server/shared/vocab.py): every sequence drafts within it.
        self.target_n_vocab: int | None = None
        self.vocab_relation = "same"  # "compatible" or "translated": what the run reports
        self.draft_token_s: float | None = None  # timed by DraftModel.warm_up, if it ran
        self.shared_decodes = 0  # of those, calls carrying more than one sequence
        self._grammars: Grammars | None = None  # compiled for this vocabulary on the first grammar
        self._grammars_lock = threading.Lock()

    def grammars(self) -> Grammars:
        """The grammars drafts follow, compiled for this vocabulary (server/shared/
        constraint.py: llguidance, imported here only when a generation has a grammar)."""
        with self._grammars_lock:
            if self._grammars is None:
                from server.shared.grammars import Grammars

                self._grammars = Grammars(self.runtime.grammar_tokenizer, self.runtime.n_vocab)
            return self._grammars

    @classmethod
    def load(
        cls,
        model_path: str | Path,
        *,
        n_ctx: int,
        n_seq: int = 1,
        n_gpu_layers: int = 0,
        n_threads: int = 0,
        verbose: bool = False,
    ) -> DraftContext:
        """`n_seq` sequences of `n_ctx` tokens each."""
        return cls(
            LlamaRuntime(
                model_path,
                n_ctx_per_seq=n_ctx,
                n_seq_max=n_seq,
                # Half the cores by default: a drafter shares its machine (a verifier beside
                # it on one host, the user's own work on a Mac); all of them, spinning
                # against a verifier's threads, collapse both.
                n_threads=n_threads or max(1, usable_cores() // 2),
                n_gpu_layers=n_gpu_layers,
                verbose=verbose,
            )
        )

    def decode(
        self, seq_id: int, tokens: Sequence[int], start: int, *, alone: bool = False
    ) -> np.ndarray:
        """Evaluate `tokens` of `seq_id` from position `start`; the logits after the last.
        On failure the sequence holds nothing from `start` on."""
        if not tokens:
            raise ValueError("nothing to decode")
        request = _Decode(seq_id, tokens, start, alone or len(tokens) > MAX_SHARED_TOKENS)
        with self._cond:
            self._queue.append(request)
            while not request.done:
                if self._busy:
                    self._cond.wait()
                    continue
                if self._closed:
                    self._queue.remove(request)
                    raise DraftModelError("the draft model is closed")
                batch = self._take()
                self._busy = True
                self._cond.release()
                unfinished: list[_Decode] = []
                try:
                    unfinished = self._run(batch)
                finally:
                    self._cond.acquire()
                    self._busy = False
                    for other in batch:  # never leave a waiter waiting for nothing
                        if not other.done and other not in unfinished:
                            other.error, other.done = DraftModelError("decode interrupted"), True
                    self._queue.extend(unfinished)  # a long one's rest: behind the others
                    self._cond.notify_all()
        if request.error is not None:
            raise request.error
        assert request.logits is not None
        return request.logits

    def remove(self, seq_id: int, p0: int) -> None:
        """Drop the sequence's cells from position p0 on (-1: all of them)."""
        with self._exclusive():
            self.runtime.remove(seq_id, p0, -1)

    def close(self) -> None:
        with contextlib.suppress(DraftModelError), self._exclusive():
            self.runtime.close()
            self._closed = True

    @contextlib.contextmanager
    def _exclusive(self):
        """llama.cpp's context is not thread-safe: no decode runs meanwhile."""
        with self._cond:
            while self._busy:
                self._cond.wait()
            if self._closed:
                raise DraftModelError("the draft model is closed")
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _take(self) -> list[_Decode]:
        """The queue's head, and behind it, in order, those that can share its decode:
        short, not alone, one per sequence, within n_batch."""
        first = self._queue.popleft()
        batch = [first]
        if first.alone:
            return batch
        n_tokens, seq_ids = len(first.tokens), {first.seq_id}
        for request in list(self._queue):
            fits = n_tokens + len(request.tokens) <= self.runtime.n_batch
            if request.alone or request.seq_id in seq_ids or not fits:
                break
            self._queue.remove(request)
            batch.append(request)
            n_tokens += len(request.tokens)
            seq_ids.add(request.seq_id)
        return batch

    def _run(self, batch: list[_Decode]) -> list[_Decode]:
        """Decode the batch, outside the lock (a long request: its next n_batch tokens).
        Returns the long requests with tokens left; every other request ends done
        (logits or error). A shared decode that fails is tried request by request."""
        outcomes = together_or_alone(batch, self._decode)
        unfinished = []
        for request, outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, Exception):
                # Its earlier chunks go too: the sequence holds nothing from its start on.
                forget(self.runtime, request.seq_id, request.start)
                request.evaluated = 0
                request.error, request.done = outcome, True
            elif request.evaluated < len(request.tokens):
                unfinished.append(request)
            else:
                request.logits, request.done = outcome, True
        return unfinished

    def _decode(self, batch: Sequence[_Decode]) -> list[np.ndarray | None]:
        """One llama_decode of each request's next chunk; the last row's logits of each
        request that is then complete (None for one with tokens left)."""
        pieces = []
        for r in batch:
            n = chunk_len(r.evaluated, len(r.tokens), self.runtime.n_batch)
            last = r.evaluated + n == len(r.tokens)
            chunk = r.tokens[r.evaluated : r.evaluated + n]
            pieces.append(Piece(r.seq_id, r.start + r.evaluated, chunk, (n - 1,) if last else ()))
        rows = decode_pieces(self.runtime, pieces)
        self.decodes += 1
        self.shared_decodes += len(batch) > 1
        for r, piece in zip(batch, pieces, strict=True):
            r.evaluated += len(piece.tokens)
        return [row[0] if len(row) else None for row in rows]
