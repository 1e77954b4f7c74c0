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
