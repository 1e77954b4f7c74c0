"""Penalties and biases on the logits, and the log-probabilities a client is shown: pure
numpy, for both sides.

OpenAI's meaning, as vLLM applies it: before temperature and the cuts, a token's logit
gets its `logit_bias`, loses `presence_penalty` if the token was generated before, and
`frequency_penalty` for each time it was (the prompt does not count). A round's row i
follows the tokens generated so far and the round's first i drafts: it is only used if
those were accepted, so it is adjusted as if they were.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from server.shared.protocol import SamplingParams


def adjusted_rows(
    logits: np.ndarray,
    sampling: SamplingParams,
    generated: Sequence[int],
    draft_tokens: Sequence[int],
) -> np.ndarray:
    """The rows of a round (one per draft token, and one after them) adjusted; `logits`
    itself where nothing adjusts them."""
    if not sampling.adjusts_logits:
        return logits
    out = logits.astype(np.float32, copy=True)
    n_vocab = out.shape[-1]
    bias = np.zeros(n_vocab, dtype=np.float32)
    for token, value in sampling.logit_bias.items():
        if token < n_vocab:
            bias[token] += value
    counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=n_vocab)[:n_vocab]
    counts = counts.astype(np.float32)
    for i in range(out.shape[0]):
        if i > 0:
            counts[draft_tokens[i - 1]] += 1
        out[i] += bias
        if sampling.frequency_penalty:
            out[i] -= sampling.frequency_penalty * counts
        if sampling.presence_penalty:
            out[i] -= sampling.presence_penalty * (counts > 0)
    return out


def token_logprobs(row: np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The token's log-probability under the row's softmax (the logits as adjusted, before
    temperature and cuts: what the model itself gives it), and the `top` likeliest tokens
    with theirs, likeliest first (ties by token id)."""
    row = row.astype(np.float64)
    shifted = row - row.max()
    log_total = np.log(np.exp(shifted).sum())
    logprobs = shifted - log_total
    best: list[tuple[int, float]] = []
    if top > 0:
        head = np.argpartition(-logprobs, top - 1)[:top]
        head = head[np.lexsort((head, -logprobs[head]))]
        # A token the grammar forbids has no probability: never among the likeliest.
        best = [(int(t), float(logprobs[t])) for t in head if np.isfinite(logprobs[t])]
    return float(logprobs[token]), best
