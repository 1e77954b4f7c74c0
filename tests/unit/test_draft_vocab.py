"""A draft model beside a verifier with a compatible vocabulary of another size (on the
fake runtime): it never drafts an id the verifier lacks, and reads the verifier's ids it
lacks itself without failing."""

from __future__ import annotations

from drafter.drafters.draft_context import DraftContext
from drafter.drafters.model import DraftModel, DraftPolicy
from server.shared.protocol import SamplingParams
from tests.fixtures.fake_runtime import FakeRuntime

PROMPTS = [[1, 5 + i, 9, 20 + i] for i in range(30)]


def drafted_ids(model: DraftModel, committed_extra: list[int] = ()) -> set[int]:
    seen: set[int] = set()
    for prompt in PROMPTS:
        model.reset()
        seen.update(model.get_candidates([*prompt, *committed_extra], 6).tokens)
    return seen


def test_a_larger_drafter_never_drafts_beyond_the_verifier_vocabulary():
    model = DraftModel.on(DraftContext(FakeRuntime(n_vocab=64)), 0)
    assert max(drafted_ids(model)) >= 40  # unmasked, the random logits go there
    model.draft_for(40, "compatible")
    assert max(drafted_ids(model)) < 40
    assert model.vocab_relation == "compatible"


def test_sampled_drafts_and_their_q_stay_inside_too():
    model = DraftModel.on(DraftContext(FakeRuntime(n_vocab=64)), 0)
    model.configure(
        DraftPolicy(sampling=SamplingParams(temperature=1.5), sample_drafts=True, seed=3)
    )
    model.draft_for(40, "compatible")
    for prompt in PROMPTS:
        model.reset()
        draft = model.get_candidates(prompt, 6)
        assert max(draft.tokens) < 40
        assert all(q[40:].sum() == 0 and abs(q.sum() - 1) < 1e-9 for q in draft.probs)


def test_verifier_ids_the_drafter_lacks_are_read_as_its_stand_in():
    runtime = FakeRuntime(n_vocab=64)
    model = DraftModel.on(DraftContext(runtime), 0)
    model.draft_for(100, "compatible")
    # 80 and 99 are padding of the verifier's: the fake runtime refuses ids >= 64.
    assert len(model.get_candidates([1, 7, 80, 9, 99], 4).tokens) == 4
    assert runtime.cells[0][:5] == [1, 7, runtime.eos_id, 9, runtime.eos_id]
    assert model.token_bytes(80) == b""
