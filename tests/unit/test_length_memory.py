"""`auto` across a `serve` slot's generations (drafter/length/length_memory.py): what one
generation measured (drafting slower than chunks here) the next starts from, instead of
drafting again until it has measured the same; the acceptance starts afresh."""

from __future__ import annotations

from drafter.length.draft_length import LinkAwareLength
from drafter.length.length_memory import LengthMemory, RememberingLength
from drafter.length.measured_rate import AHEAD_PRIOR
from drafter.speculative.candidates import RoundTiming


def generation(length: LinkAwareLength, rounds: int) -> list[int]:
    """Where the verifier advises one draft, but the draft model takes a verifier step a
    token and half its drafts are accepted: chunks of the verifier's own tokens come
    faster. The draft lengths sent, 0 for a chunk."""
    length.advise(1)
    sent = []
    for _ in range(rounds):
        k = length.next()
        sent.append(k)
        if k == 0:
            m = length.chunk()
            length.update(0, 0)
            length.observe(
                RoundTiming(1, m * 0.01, m * 0.01 + 0.001, 0.0, False, steps=m, tokens=m)
            )
        else:
            length.update(k, k // 2)
            seconds = 0.01 + 0.003 * k
            length.observe(
                RoundTiming(k + 1, seconds, seconds + 0.001, 0.01 * k, False, 1, k // 2 + 1)
            )
        length.advise(1)
    return sent


def test_a_slots_next_generation_starts_from_what_the_last_one_measured():
    memory = LengthMemory()
    first = generation(
        RememberingLength(maximum=16, max_chunk=64, watched=False, memory=memory), 12
    )
    assert first[0] > 0 and 0 in first  # it drafted, measured, and went to chunks
    assert memory.fit and memory.draft_s and memory.draft_rate and memory.chunk_rate
    # No draft was ever ready when its answer came: the next generation knows it too.
    assert memory.ahead_share is not None and memory.ahead_share < AHEAD_PRIOR
    assert RememberingLength(maximum=16, memory=memory)._ahead_share == memory.ahead_share
    second = generation(
        RememberingLength(maximum=16, max_chunk=64, watched=False, memory=memory), 4
    )
    assert second == [0, 0, 0, 0]  # chunks from the first round
    fresh = generation(LinkAwareLength(maximum=16, max_chunk=64, watched=False), 4)
    assert fresh[0] > 0  # with nothing measured, drafting first, as the first generation did
    # The acceptance is the text's: never carried.
    assert RememberingLength(maximum=16, memory=memory).acceptance == LinkAwareLength(16).acceptance
