"""Target and draft distributions from logits: pure numpy, no llama_cpp.

Both sides use these same transforms, in this order (as vLLM does): logits divided by
the temperature, softmax, top-k (keep the k most likely), top-p (keep the smallest set of
most likely tokens whose mass reaches p), renormalize. Ties at a cut are broken by token
id so both sides cut identically.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

from server.shared.protocol import SamplingParams


def probabilities(logits: np.ndarray, sampling: SamplingParams) -> np.ndarray:
    """Dense distribution over the vocabulary; zero outside the kept support. Finite for
    any finite logits (-inf allowed: a masked token) and any valid SamplingParams (a
    temperature of 0 or at least MIN_TEMPERATURE): tests/unit/test_sampling_properties.py."""
    if sampling.greedy:
        probs = np.zeros(logits.shape[-1], dtype=np.float64)
        probs[int(np.argmax(logits))] = 1.0
        return probs
    scaled = logits.astype(np.float64) / sampling.temperature
    scaled -= scaled.max()
    probs = np.exp(scaled)
    probs /= probs.sum()
    top_k = sampling.top_k if 0 < sampling.top_k < probs.size else 0
    if top_k or sampling.top_p < 1.0:
        if top_k:
            # Partition first: only the k candidates need sorting.
            candidates = np.argpartition(-probs, top_k - 1)[:top_k]
            candidates = candidates[np.lexsort((candidates, -probs[candidates]))]
        else:
            candidates = _nucleus_candidates(probs, sampling.top_p)
        keep = candidates.size
        if sampling.top_p < 1.0:
            kept = probs[candidates]
            # After a top-k cut, top-p applies to the renormalized k; otherwise to the whole
            # distribution (the candidates are only its head).
            cumulative = np.cumsum(kept / kept.sum() if top_k else kept)
            keep = min(keep, int(np.searchsorted(cumulative, sampling.top_p)) + 1)
        mask = np.zeros(probs.size, dtype=bool)
        mask[candidates[:keep]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return probs


def _nucleus_candidates(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Tokens sorted by probability, enough of them to reach `top_p` (usually a few
    hundred: sorting only those is ~10x faster than sorting the vocabulary)."""
    width = 256
    while width < probs.size:
        head = np.argpartition(-probs, width - 1)[:width]
        if probs[head].sum() >= top_p:
            return head[np.lexsort((head, -probs[head]))]
        width *= 4
    return np.argsort(-probs, kind="stable")


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw by inverse CDF: exactly one uniform from `rng` per call."""
    cumulative = np.cumsum(probs)
    u = rng.random() * cumulative[-1]
    index = int(np.searchsorted(cumulative, u, side="right"))
    # Guard the float edge (u == total): never land on a zero-probability token.
    index = min(index, probs.size - 1)
    while probs[index] <= 0.0:
        index -= 1
    return index


def sparse(probs: np.ndarray) -> list[tuple[int, float]]:
    """The support as [token_id, prob] pairs, most likely first."""
    support = np.flatnonzero(probs)
    support = support[np.argsort(-probs[support], kind="stable")]
    return [(int(t), float(probs[t])) for t in support]


def dense(pairs: list[tuple[int, float]], n_vocab: int) -> np.ndarray:
    probs = np.zeros(n_vocab, dtype=np.float64)
    for token, prob in pairs:
        probs[token] += prob
    return probs


def cap_support(probs: np.ndarray, max_support: int) -> np.ndarray:
    """Keep the `max_support` most likely tokens, renormalized.

    The drafter samples from this capped q and sends exactly it, so rejection sampling
    stays lossless: the guarantee needs the draft drawn from the q the verifier sees,
    not from any particular q.
    """
    support = np.flatnonzero(probs)
    if support.size <= max_support:
        return probs
    order = support[np.argsort(-probs[support], kind="stable")][:max_support]
    capped = np.zeros_like(probs)
    capped[order] = probs[order]
    renormalized: np.ndarray = capped / capped.sum()
    return renormalized


@dataclass(frozen=True, slots=True)
class PositionDraws:
    """A generation's random numbers on the verifier. The token at each position (counted
    from the first generated token) is decided with numbers drawn from a stream of its
    own, keyed by the seed and that position (numpy's independent child streams): what
    decides a token depends on where it stands, never on how many rounds, drafts or
    sessions came before it. So a session opened again from its generated tokens draws
    on as the lost one would have, and a round undone leaves nothing to put back."""

    seed: int

    @classmethod
    def seeded(cls, seed: int | None) -> PositionDraws:
        """The request's seed, or (none given) one of the generation's own."""
        return cls(secrets.randbits(128) if seed is None else seed)

    def at(self, position: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(position,)))
