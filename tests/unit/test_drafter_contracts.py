"""The drafter's contracts (drafter/speculative/candidates.py): every drafter is a `Drafter` and
every
draft-length policy a `DraftLength`, each hook declared with its default, so the loop asks
for none by name; a combined drafter forwards every hook to the drafter behind it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from drafter.drafters.history_lookup import HistoryLookup
from drafter.drafters.model import DraftModel
from drafter.drafters.ngram import ModelWithLookup, NgramDrafter
from drafter.drafters.suffix import SuffixDrafter
from drafter.drafters.translate import TranslatingDrafter
from drafter.length.draft_length import LinkAwareLength
from drafter.length.plain_lengths import DoublingLength, FixedLength
from drafter.speculative.candidates import Draft, Drafter, DraftLength
from server.shared.protocol import PrefillRequest, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
HOOKS = [n for n, v in vars(Drafter).items() if callable(v) and not n.startswith("_")]
LOOP_MODULES = [
    "speculative/loop",
    "speculative/warming",
    "speculative/speculation",
    "speculative/draft_readiness",
    "drafters/ngram",
    "runner",
]


def test_every_drafter_and_length_stands_on_its_contract():
    drafters = (DraftModel, NgramDrafter, SuffixDrafter, HistoryLookup, ModelWithLookup)
    for drafter in (*drafters, TranslatingDrafter):
        assert issubclass(drafter, Drafter), drafter
        assert drafter.get_candidates is not Drafter.get_candidates, drafter
    for length in (FixedLength, DoublingLength, LinkAwareLength):
        assert issubclass(length, DraftLength), length
    assert set(HOOKS) >= {"get_candidates", "warm", "catch_up", "follow", "likely_answers"}


def test_the_loop_finds_no_ability_by_name():
    for name in LOOP_MODULES:
        tree = ast.parse((ROOT / "drafter" / f"{name}.py").read_text())
        called = {
            node.func.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        }
        assert not called & {"getattr", "hasattr"}, name


class Recording(Drafter):
    """Answers every hook, recording which were called."""

    warms = catches_up = True

    def __init__(self):
        self.calls: list[str] = []

    def get_candidates(self, committed, k, stop=None):
        self.calls.append("get_candidates")
        return Draft([1] * k, None)

    def warm(self, prefill, stop=None):
        self.calls.append("warm")

    def catch_up(self, committed, stop=None):
        self.calls.append("catch_up")
        return False

    def follow(self, sampling, grammar, prompt_len):
        self.calls.append("follow")

    def likely_answers(self, committed, draft, limit):
        self.calls.append("likely_answers")
        return [(0, 9)]

    def answered(self, draft, verified, accepted_prefix_len):
        self.calls.append("answered")

    def finish(self, text):
        self.calls.append("finish")


def test_model_with_lookup_forwards_every_hook_to_the_model_but_a_lookups_ranking():
    model = Recording()
    both = ModelWithLookup(NgramDrafter(10), model)
    assert (both.warms, both.catches_up) == (True, True)
    assert both.likely_answers([1, 2], [3], 4) == [(0, 9)]  # the model's draft: its ranking
    assert both.likely_answers([5, 6, 7, 5, 6], [7], 4) is None  # a lookup's: not ranked
    assert both.get_candidates([1, 2, 3, 4], 2).tokens == [1, 1]  # no match: the model's
    both.warm(PrefillRequest(prompt_tokens=[1, 2]))
    assert both.catch_up([1, 2]) is False
    both.follow(SamplingParams(), None, 2)
    both.finish([1, 2, 3])
    both.answered(Draft([1, 1], None), 2, 1)  # the model's draft: the model's to learn from
    both.answered(Draft([7], None, lookup=True), 1, 1)  # the lookup's: not the model's
    # A lookup's own draft, for a round the model would not draft: the lookup's alone.
    assert both.lookup_draft([5, 6, 7, 5, 6], 2).tokens == [7, 5]
    assert both.lookup_draft([1, 2, 3, 4], 2).tokens == []
    assert sorted(model.calls) == sorted(set(HOOKS) - {"lookup_draft"})
    for hook in HOOKS:  # each overridden, none left to the default
        assert getattr(ModelWithLookup, hook) is not getattr(Drafter, hook), hook


def test_a_drafter_declares_its_defaults():
    class Plain(Drafter):
        def get_candidates(self, committed, k, stop=None):
            return Draft([], None)

    plain = Plain()
    assert (plain.warms, plain.catches_up) == (False, False)
    assert plain.catch_up([1]) is True and plain.likely_answers([1], [2], 3) is None
    assert inspect.signature(plain.follow).parameters.keys() == {"sampling", "grammar",
                                                                  "prompt_len"}  # fmt: skip
