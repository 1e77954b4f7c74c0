"""Is this build, on this device, batch-invariant? Checked at startup, where the server runs.

Greedy speculative decoding is token for token the verifier's own output only if a row's
logits do not depend on what else is in its `llama_decode` batch: a verify round decodes
k+1 tokens at once, beside other sessions' rounds, where the verifier alone decodes one.
llama.cpp's CPU kernels with flash attention are (DESIGN.md, Numerics); GPU kernels that
pick another algorithm for another batch size need not be. So the engine decodes one short
probe three ways and compares the logits bit for bit:

1. one token at a time (how `/generate` would see it with nobody else around);
2. the probe's tokens as one batch (a verify round);
3. the same batch beside another sequence's tokens (a round sharing its batch).

Rounds are short; prompts are evaluated in long chunks, and a chunk's length can decide
the kernel (llama.cpp's CPU build takes another path from 64 rows of one sequence on, with
other numbers). So the probe also evaluates a longer prompt in one chunk and in two, and
reports whether the next token's logits agree: the scheduler always cuts a prompt at the
same places, so this decides only whether a cached prefix (cut elsewhere) may be reused.
Given several chunk lengths, the probe tries them longest first and reports the first that
passes: the engine then cuts prompts that short, and reuse is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from server.runtime import BatchEntry

PROBE_TEXT = (
    "Speculative decoding checks a whole draft in one pass, so the numbers must not "
    "depend on the batch: 3, 5, 8, 13, 21."
)
PROBE_ROUND = 9  # tokens compared: a round of k = 8
PROBE_PROMPT = 128  # the chunking check's prompt: past the lengths where kernels change
# Shorter prompt chunks tried when prompt reuse is wanted and n_batch is not exact.
AUTO_PROMPT_CHUNKS = (48, 32, 16)


class ProbeRuntime(Protocol):
    n_batch: int
    n_ctx_per_seq: int

    def tokenize(self, text: str, *, add_special: bool) -> list[int]: ...

    def decode(self, entries: list[BatchEntry]) -> np.ndarray: ...

    def clear(self, seq_id: int) -> None: ...


@dataclass(frozen=True)
class InvarianceReport:
    batch_invariant: bool
    max_abs_diff: float  # the largest logit difference between any two ways
    argmax_agrees: bool  # the greedy choice at every probed position, all ways
    positions: int
    prefill_chunk_invariant: bool = True  # a prompt cut elsewhere gives the same logits
    prefill_chunk_max_diff: float = 0.0
    prompt_chunk: int = 0  # the chunk length those two describe


def compare(reference: np.ndarray, others: list[np.ndarray]) -> InvarianceReport:
    """Bit-for-bit comparison of logits rows from several ways of batching (pure)."""
    diff = 0.0
    argmax_agrees = True
    for rows in others:
        if rows.shape != reference.shape:
            raise ValueError(f"probe rows {rows.shape} against {reference.shape}")
        diff = max(diff, float(np.max(np.abs(rows.astype(np.float64) - reference))))
        argmax_agrees &= bool(np.array_equal(rows.argmax(axis=1), reference.argmax(axis=1)))
    return InvarianceReport(
        batch_invariant=diff == 0.0,
        max_abs_diff=diff,
        argmax_agrees=argmax_agrees,
        positions=reference.shape[0],
    )


def prompt_chunks(n_batch: int, requested: int, reuse: bool, shortest: int) -> list[int]:
    """Prompt chunk lengths to probe, the preferred first: `requested` (0 = n_batch); with
    reuse wanted and nothing requested, shorter ones too, down to `shortest` (a round's
    rows: a reused prefix holds rounds, which must take the kernels a chunk takes). Reuse
    is exact only where a prompt's numbers do not depend on its cuts: short chunks cost a
    cold prompt time and save every later turn of a conversation."""
    first = min(requested or n_batch, n_batch)
    if requested or not reuse:
        return [first]
    return [first, *(n for n in AUTO_PROMPT_CHUNKS if shortest <= n < first)]


def probe(
    runtime: ProbeRuntime, seq_a: int, seq_b: int | None, prompt_chunks: Sequence[int]
) -> InvarianceReport:
    """Decode the probe three ways on empty sequences `seq_a` and `seq_b` (None: only one
    sequence exists, the third way is skipped) and compare; then check prompt chunking at
    each of `prompt_chunks` in turn until one passes. Leaves both sequences empty."""
    # Every batch fits n_batch (nothing is split into ubatches) and every sequence its
    # context, however small the server is configured.
    limit = min(runtime.n_batch, runtime.n_ctx_per_seq)
    ids = runtime.tokenize(PROBE_TEXT, add_special=True)[:limit]
    n_round = min(PROBE_ROUND, len(ids) - 1, runtime.n_batch // 2)  # two rounds fit a batch
    context, probed = ids[:-n_round], ids[-n_round:]

    def fill(seq_id: int, tokens: list[int]) -> None:
        runtime.clear(seq_id)
        runtime.decode([BatchEntry(t, i, seq_id, False) for i, t in enumerate(tokens)])

    def round_entries(seq_id: int, tokens: list[int], start: int) -> list[BatchEntry]:
        return [BatchEntry(t, start + i, seq_id, True) for i, t in enumerate(tokens)]

    try:
        fill(seq_a, context)
        one_at_a_time = np.concatenate(
            [runtime.decode([entry]) for entry in round_entries(seq_a, probed, len(context))]
        )
        fill(seq_a, context)
        ways = [runtime.decode(round_entries(seq_a, probed, len(context)))]
        if seq_b is not None:
            # seq_b = seq_a + 1 after seq_a, with as many rows: llama.cpp (kv_unified off)
            # puts the two in one micro-batch only so.
            fill(seq_a, context)
            fill(seq_b, context[::-1])
            neighbour = round_entries(seq_b, probed[::-1], len(context))
            rows = runtime.decode([*round_entries(seq_a, probed, len(context)), *neighbour])
            ways.append(rows[:n_round])
        # Shorter chunks are sought only for reuse, which needs invariant rounds anyway.
        if not compare(one_at_a_time, ways).batch_invariant:
            prompt_chunks = prompt_chunks[:1]
        chunk_diffs = []
        for prompt_chunk in prompt_chunks:
            chunk_diffs.append(_prompt_chunking(runtime, seq_a, prompt_chunk))
            if chunk_diffs[-1] == 0.0:
                break
    finally:
        runtime.clear(seq_a)
        if seq_b is not None:
            runtime.clear(seq_b)
    # The passing length, or (none passing) the first, longest, with its difference.
    chosen = len(chunk_diffs) - 1 if chunk_diffs[-1] == 0.0 else 0
    return replace(
        compare(one_at_a_time, ways),
        prefill_chunk_invariant=chunk_diffs[chosen] == 0.0,
        prefill_chunk_max_diff=chunk_diffs[chosen],
        prompt_chunk=prompt_chunks[chosen],
    )


def _prompt_chunking(runtime: ProbeRuntime, seq_id: int, prompt_chunk: int) -> float:
    """The largest logit difference for a prompt's next token between the prompt
    evaluated in one chunk of up to `prompt_chunk` tokens and cut elsewhere. The cuts fall
    off any power-of-two grid: kernels that work in tiles of rows agree with themselves
    when cuts fall on tiles."""
    # One chunk as long as the scheduler's longest (up to PROBE_PROMPT), then the next token.
    limit = min(prompt_chunk, runtime.n_batch, runtime.n_ctx_per_seq - 1, PROBE_PROMPT) + 1
    ids = runtime.tokenize(PROBE_TEXT * 8, add_special=True)[:limit]
    *prompt, last = ids
    rows = []
    n = len(prompt)
    odd = min(37, n // 2) | 1
    for cuts in ([n], [odd, n - odd], [n - 1, 1]):
        runtime.clear(seq_id)
        start = 0
        for n in cuts:
            chunk = prompt[start : start + n]
            runtime.decode([BatchEntry(t, start + i, seq_id, False) for i, t in enumerate(chunk)])
            start += n
        rows.append(runtime.decode([BatchEntry(last, len(prompt), seq_id, True)])[0])
    return max(float(np.max(np.abs(rows[0].astype(np.float64) - row))) for row in rows[1:])
