"""The draft model's llama.cpp context, shared by the sequences of concurrent generations.

`serve --parallel N` gives each generation its own KV sequence in one context. Threads
that want a decode while another decode runs queue up, and the next decode takes all of
them that fit in one batch (group commit): drafts of concurrent requests that line up
share a `llama_decode`, and no thread ever waits on a timer for batch-mates.

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

import numpy as np

from drafter.errors import DraftModelError
from server.runtime import BatchEntry, LlamaRuntime

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
        # server/vocab.py): every sequence drafts within it.
        self.target_n_vocab: int | None = None
        self.vocab_relation = "same"  # "compatible" or "translated": what the run reports
        self.shared_decodes = 0  # of those, calls carrying more than one sequence

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
                n_threads=n_threads,
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
        """Decode the batch, outside the lock. Returns the long requests with tokens
        left; every other request ends done (logits or error)."""
        if len(batch) == 1:
            return self._run_alone(batch[0])
        entries = [
            BatchEntry(token, r.start + i, r.seq_id, i == len(r.tokens) - 1)
            for r in batch
            for i, token in enumerate(r.tokens)
        ]
        try:
            rows = self.runtime.decode(entries)
        except Exception:
            # One request may be at fault (a full sequence): each goes again on its own,
            # so only that one fails.
            for request in batch:
                self._forget(request)
            return [r for request in batch for r in self._run_alone(request)]
        self.decodes += 1
        self.shared_decodes += 1
        for request, row in zip(batch, rows, strict=True):
            request.logits, request.done = row, True
        return []

    def _run_alone(self, request: _Decode) -> list[_Decode]:
        """Its next n_batch tokens; the request back if more are left (so a long prompt
        does not hold up other sequences' drafts)."""
        n = request.evaluated
        chunk = request.tokens[n : n + self.runtime.n_batch]
        last = n + len(chunk) == len(request.tokens)
        final = len(chunk) - 1 if last else -1  # the row whose logits are wanted
        entries = [
            BatchEntry(token, request.start + n + i, request.seq_id, i == final)
            for i, token in enumerate(chunk)
        ]
        try:
            rows = self.runtime.decode(entries)
        except Exception as exc:
            self._forget(request)
            request.error, request.done = exc, True
            return []
        self.decodes += 1
        request.evaluated += len(chunk)
        if not last:
            return [request]
        request.logits, request.done = rows[0], True
        return []

    def _forget(self, request: _Decode) -> None:
        """Its cells gone: the sequence holds nothing from the request's start on."""
        with contextlib.suppress(Exception):
            self.runtime.remove(request.seq_id, request.start, -1)
        request.evaluated = 0
