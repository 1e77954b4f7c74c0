"""Acceptance rules: pure functions, no llama_cpp.

Vocabulary (after vLLM's rejection sampler and Leviathan et al.):
- draft tokens d_1..d_k: the drafter's proposal for the positions after the pending token;
- target tokens t_0..t_k: the verifier's own choice at each of those k+1 positions
  (t_i is chosen after seeing the pending token and d_1..d_i);
- accepted tokens: the longest prefix of the draft the verifier agrees with (m of them);
- recovered token: the verifier's token at the first disagreement, replacing d_{m+1};
- bonus token: the verifier's token after all k drafts were accepted.
A round commits the m accepted tokens plus exactly one recovered-or-bonus token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from server.shared.protocol import SamplingParams
from server.shared.sampling import probabilities, sample


@dataclass(frozen=True, slots=True)
class Verdict:
    accepted_prefix_len: int
    tokens: list[int]  # accepted drafts, then one recovered or bonus token
    eos: bool


def accept_greedy(
    draft_tokens: Sequence[int],
    target_tokens: Sequence[int],
    is_eog: Callable[[int], bool],
) -> Verdict:
    """Greedy verification: accept drafts while they equal the target's argmax.

    An accepted draft token that ends generation closes the round there: it is the
    target's own choice at that position, so it is committed as the target token and
    nothing after it is.
    """
    if len(target_tokens) != len(draft_tokens) + 1:
        raise ValueError("need one target token per draft position plus one")
    accepted_prefix_len = 0
    for draft_token, target_token in zip(draft_tokens, target_tokens, strict=False):
        if draft_token != target_token:
            break
        if is_eog(draft_token):
            break
        accepted_prefix_len += 1
    final_token = target_tokens[accepted_prefix_len]
    return Verdict(
        accepted_prefix_len=accepted_prefix_len,
        tokens=[*draft_tokens[:accepted_prefix_len], final_token],
        eos=is_eog(final_token),
    )


# -- sampling strategies ------------------------------------------------------------------
# `target_probs` holds k+1 rows: the target's distribution p after the pending token and
# after each draft token, already tempered and cut (server/shared/sampling.py). What is
# decided at row i is decided with uniforms from `draws(i)` (the stream of that row's
# position: sampling.PositionDraws), in a fixed order: a draft token's acceptance test,
# then the draw of a token. No uniform decides two rows, and the draft a row judges was
# made without it: every decision's uniforms are fresh, so the rules stay exact.
Draws = Callable[[int], np.random.Generator]


def residual_distribution(target: np.ndarray, draft: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)): where the recovered token comes from after a rejection."""
    residual = np.maximum(target - draft, 0.0)
    total = residual.sum()
    # p == q leaves nothing (and a rejection then has probability 0): fall back to p.
    return residual / total if total > 0 else target


def acceptance_probability(target_prob: float, draft_prob: float) -> float:
    """min(1, p(x)/q(x)); a token the drafter gave no mass is never accepted."""
    if draft_prob <= 0.0:
        return 0.0
    if target_prob >= draft_prob:  # (no division: a denormal q would overflow it)
        return 1.0
    return target_prob / draft_prob


def accept_rejection(
    draft_tokens: Sequence[int],
    draft_probs: Sequence[np.ndarray],
    target_probs: np.ndarray,
    draws: Draws,
    is_eog: Callable[[int], bool],
) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Draft token x_i, drawn from q_i, is accepted with probability min(1, p_i(x)/q_i(x));
    at the first rejection the recovered token is drawn from norm(max(0, p_i - q_i)); if
    all k are accepted the bonus token is drawn from p_k. The committed tokens are
    distributed exactly as sampling from p alone.
    """
    for i, token in enumerate(draft_tokens):
        accept = acceptance_probability(target_probs[i][token], draft_probs[i][token])
        stream = draws(i)
        if stream.random() < accept:
            if is_eog(token):
                return Verdict(i, [*draft_tokens[:i], token], True)
            continue
        recovered = sample(residual_distribution(target_probs[i], draft_probs[i]), stream)
        return Verdict(i, [*draft_tokens[:i], recovered], is_eog(recovered))
    bonus = sample(target_probs[len(draft_tokens)], draws(len(draft_tokens)))
    return Verdict(len(draft_tokens), [*draft_tokens, bonus], is_eog(bonus))


def accept_match(
    draft_tokens: Sequence[int],
    target_probs: np.ndarray,
    draws: Draws,
    is_eog: Callable[[int], bool],
) -> Verdict:
    """Sample-and-match: the target samples its own token at each position and the draft
    is accepted while it equals that sample. Every committed token is the target's own
    draw, so the output follows p with no probabilities on the wire."""
    for i in range(len(draft_tokens) + 1):
        token = sample(target_probs[i], draws(i))
        if i < len(draft_tokens) and token == draft_tokens[i] and not is_eog(token):
            continue
        return Verdict(i, [*draft_tokens[:i], token], is_eog(token))
    raise AssertionError("unreachable: the last position always returns")


def accept_threshold(
    draft_tokens: Sequence[int],
    target_probs: np.ndarray,
    threshold: float,
    draws: Draws,
    is_eog: Callable[[int], bool],
) -> Verdict:
    """LOSSY: accept a draft token when the target gives it p(x) >= threshold; otherwise
    draw the target's own token from p. Faster, but the output no longer follows p."""
    for i, token in enumerate(draft_tokens):
        if target_probs[i][token] >= threshold:
            if is_eog(token):
                return Verdict(i, [*draft_tokens[:i], token], True)
            continue
        recovered = sample(target_probs[i], draws(i))
        return Verdict(i, [*draft_tokens[:i], recovered], is_eog(recovered))
    bonus = sample(target_probs[len(draft_tokens)], draws(len(draft_tokens)))
    return Verdict(len(draft_tokens), [*draft_tokens, bonus], is_eog(bonus))


def judge(
    strategy: str,
    draft_tokens: Sequence[int],
    draft_probs: Sequence[np.ndarray] | None,
    logits: np.ndarray,
    target_tokens: Sequence[int],
    sampling: SamplingParams,
    threshold: float | None,
    draws: Draws,
    is_eog: Callable[[int], bool],
) -> Verdict:
    """A round's verdict under the session's strategy, from the target's k+1 logits rows
    (`target_tokens` is their argmax); `draws(i)`: the random stream of row i's position."""
    if strategy == "greedy":
        return accept_greedy(draft_tokens, target_tokens, is_eog)
    target_probs = np.stack([probabilities(row, sampling) for row in logits])
    if strategy == "rejection":
        if not draft_tokens:
            return accept_match([], target_probs, draws, is_eog)
        assert draft_probs is not None  # the engine refuses such a round without them
        return accept_rejection(draft_tokens, draft_probs, target_probs, draws, is_eog)
    if strategy == "match":
        return accept_match(draft_tokens, target_probs, draws, is_eog)
    assert threshold is not None  # the session was refused without one
    return accept_threshold(draft_tokens, target_probs, threshold, draws, is_eog)
