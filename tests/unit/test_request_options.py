"""A generation's options apart from the process's settings (drafter/request_options.py),
whose caches `serve` hands a generation (its principal's), and the verifier's vocabulary
facts as one model (InfoResponse.vocabulary)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from drafter.request_options import RequestOptions
from drafter.runner import draft_policy, pipelined
from drafter.serve.slots import GenerationSlot
from drafter.settings import DrafterSettings
from drafter.speculative.loop import SpeculativeResult
from server.shared.info import InfoResponse
from server.shared.protocol import Grammar, PrefillRequest, PromptInput, SamplingParams, Strategy
from server.shared.vocab import VocabFacts

GRAMMAR = Grammar(kind="regex", source="[a-z]+")


def test_the_clis_options_are_what_its_settings_say():
    settings = DrafterSettings(
        temperature=0.7, top_k=40, top_p=0.9, seed=3, strategy="threshold", threshold=0.4,
        max_tokens=12, pipeline=True, p_min=0.2, draft_n=5,
    )  # fmt: skip
    assert settings.request_options() == RequestOptions(
        sampling=SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=3),
        strategy=Strategy.threshold,
        threshold=0.4,
        max_tokens=12,
        pipeline=True,
    )
    plain = DrafterSettings().request_options()
    assert plain.sampling == SamplingParams() and plain.max_tokens == 80
    assert plain.pipeline is None and plain.effective_strategy == Strategy.greedy
    # Process configuration stays in the settings: the draft policy reads p_min there.
    assert draft_policy(settings, settings.request_options()).p_min == 0.2


def test_a_bad_sampling_setting_is_still_refused_when_the_settings_are_made():
    with pytest.raises(ValueError, match="temperature"):
        DrafterSettings(temperature=1e-7)


def test_a_requests_options_are_its_own_and_not_the_process_settings():
    sampling = SamplingParams(
        temperature=0.5, top_k=7, presence_penalty=0.3, logit_bias={5: -100.0}
    )
    options = RequestOptions.for_request(sampling, 9, GRAMMAR, logprobs=2)
    assert options.sampling == sampling and options.max_tokens == 9
    assert options.grammar == GRAMMAR and options.logprobs == 2
    assert options.strategy is None and options.effective_strategy == Strategy.rejection
    assert options.pipeline is None  # the process's --pipeline decides
    seeded = RequestOptions.for_request(SamplingParams(temperature=0.5, seed=1), 9)
    assert seeded.pipeline is False  # its draws must not depend on timing
    greedy_seed = RequestOptions.for_request(SamplingParams(seed=1), 9)
    assert greedy_seed.pipeline is None  # greedy has no draws to fix


def test_a_bad_logprobs_is_refused_where_the_options_are_made():
    with pytest.raises(ValueError, match="logprobs"):
        RequestOptions.for_request(SamplingParams(), 4, logprobs=21)


def test_the_prefill_carries_the_prompt_and_every_option():
    options = RequestOptions(
        sampling=SamplingParams(temperature=0.8, frequency_penalty=0.5),
        grammar=GRAMMAR,
        strategy=Strategy.match,
        logprobs=0,
        max_tokens=4,
    )
    prefill = options.prefill(PromptInput(prompt_tokens=[1, 2, 3], add_bos=False))
    assert prefill == PrefillRequest(
        prompt_tokens=[1, 2, 3],
        add_bos=False,
        sampling=options.sampling,
        grammar=GRAMMAR,
        strategy=Strategy.match,
        logprobs=0,
    )
    text = RequestOptions(max_tokens=4).prefill(PromptInput(prompt="hi"))
    assert text.model_dump_json() == PrefillRequest(prompt="hi").model_dump_json()


def test_through_text_matches_where_rejection_would_sample():
    sampled = RequestOptions(sampling=SamplingParams(temperature=0.9), max_tokens=4)
    assert sampled.through_text().strategy == Strategy.match
    greedy = RequestOptions(max_tokens=4)
    assert greedy.through_text() is greedy
    lossy = sampled.model_copy(update={"strategy": Strategy.threshold, "threshold": 0.3})
    assert lossy.through_text() is lossy


@pytest.mark.parametrize(
    ("settings", "sampling", "serve", "expected"),
    [
        ({}, {}, True, True),
        ({"drafter": "ngram"}, {}, True, False),
        ({"pipeline": False}, {}, True, False),
        ({}, {"temperature": 0.7, "seed": 4}, True, False),
        ({"pipeline": True}, {"temperature": 0.7, "seed": 4}, True, False),  # serve: never
        ({"pipeline": True}, {"temperature": 0.7, "seed": 4}, False, True),  # the CLI: asked
        ({}, {"temperature": 0.7, "seed": 4}, False, False),
    ],
)
def test_pipelined_as_the_request_then_the_process_says(settings, sampling, serve, expected):
    process = DrafterSettings(**settings)
    if serve:
        options = RequestOptions.for_request(SamplingParams(**sampling), 8)
    else:
        options = DrafterSettings(**settings, **sampling).request_options()
    assert pipelined(process, options) is expected


class _Model:
    """What a generation reads of a draft model: its cache, emptied by `reset`."""

    decodes_alone = False

    def __init__(self, cached: list[int]):
        self.cached_tokens = cached
        self.runtime = SimpleNamespace(token_bytes=lambda token: b"")
        self.token_bytes = self.runtime.token_bytes

    def reset(self) -> None:
        self.cached_tokens = []


class _Loop:
    def __init__(self):
        self.result = SpeculativeResult()
        self.ran: list[tuple[PrefillRequest, int]] = []

    def run(self, prefill, max_tokens):
        self.ran.append((prefill, max_tokens))
        yield from ()


def test_serve_hands_the_loop_the_requests_options_and_the_process_settings(monkeypatch):
    from drafter.serve import backend as serve_backend

    # The process's settings say otherwise: a request's sampling and limit are its own.
    settings = DrafterSettings(temperature=0.0, top_k=3, max_tokens=80, draft_n=5)
    backend = serve_backend.SpeculativeBackend(settings)
    backend.info = InfoResponse.model_construct(model="m", n_ctx=64)
    loop, seen = _Loop(), {}

    def speculative_loop(model, client, info, process, options, *rest):
        seen.update(process=process, options=options)
        return loop

    monkeypatch.setattr(serve_backend, "speculative_loop", speculative_loop)
    slot = GenerationSlot(_Model([]), SimpleNamespace())  # type: ignore[arg-type]
    sampling = SamplingParams(temperature=0.6, top_p=0.9, seed=2, presence_penalty=0.1)
    options = RequestOptions.for_request(sampling, 7, GRAMMAR, logprobs=1)
    prompt = PromptInput(prompt="Hello")
    generation = serve_backend.Generation(
        prompt=prompt, options=options, prompt_ids=[1], stop=[], emit=lambda *_: None
    )
    try:
        backend._generate(slot, generation)
    finally:
        backend.close()
    assert seen["process"] is settings and seen["options"] is options
    assert loop.ran == [(options.prefill(prompt), 7)]
    sent = loop.ran[0][0]
    assert sent.sampling == sampling and sent.grammar == GRAMMAR and sent.logprobs == 1
    assert sent.strategy is None


@pytest.mark.parametrize(
    ("keys", "verifier_scopes", "scoped"),
    [
        ("sk-a,sk-b", True, True),  # clients of their own keys: each key its own caches
        ("sk-a,sk-b", False, False),  # an older verifier refuses a field it does not know
        (None, True, False),  # one user's loopback `serve`: one principal, as ever
    ],
)
def test_serve_hands_a_generation_only_its_principals_caches(
    monkeypatch, keys, verifier_scopes, scoped
):
    """The attack's shape: B's prompt shares a long prefix with A's recent one, which the
    slot B is given still holds: B's generation starts empty (draft_cached_tokens 0) and
    its prefill names B's scope to the verifier; B's own repeat reuses its cache."""
    from drafter.serve import backend as serve_backend

    backend = serve_backend.SpeculativeBackend(DrafterSettings(serve_api_key=keys))
    backend.info = InfoResponse.model_construct(model="m", n_ctx=64, cache_scopes=verifier_scopes)
    loops: list[_Loop] = []

    def speculative_loop(*_args):
        loops.append(_Loop())
        return loops[-1]

    monkeypatch.setattr(serve_backend, "speculative_loop", speculative_loop)
    a, b = ("key-0", "key-1") if keys else (None, None)
    prompt = [1, 2, 3, 4]
    slot = GenerationSlot(_Model(prompt), SimpleNamespace(), principal=a)  # type: ignore[arg-type]
    slot.length_memory.step_s = 0.5  # what A's generation measured

    def generate(principal: str | None) -> int:
        generation = serve_backend.Generation(
            prompt=PromptInput(prompt_tokens=prompt),
            options=RequestOptions.for_request(SamplingParams(), 4),
            prompt_ids=prompt,
            stop=[],
            emit=lambda *_: None,
            principal=principal,
        )
        figures = backend._generate(slot, generation).figures
        assert figures is not None
        return figures.draft_cached_tokens

    try:
        first = generate(b)
        slot.model.cached_tokens = prompt  # what B's generation left in it
        again = generate(b)
    finally:
        backend.close()
    assert again == len(prompt)
    if keys:
        assert first == 0 and slot.principal == "key-1" and slot.length_memory.step_s is None
    else:
        assert first == len(prompt) and slot.length_memory.step_s == 0.5
    sent = [loop.ran[0][0].cache_scope for loop in loops]
    if scoped:
        assert (
            sent[0]
            == sent[1]
            == backend.caches.verifier_scope("key-1")
            != (backend.caches.verifier_scope("key-0"))
        )
        assert "key" not in sent[0] and "sk-" not in sent[0]
    else:
        assert sent == [None, None]


VOCAB = VocabFacts(
    type="bpe", n_vocab=300, bos_id=1, eos_id=2, add_bos=True, add_eos=False, hash="ab" * 32,
    text_hashes={180: "x" * 32, 300: "y" * 32},
)  # fmt: skip
INFO = {
    "model": "m", "model_path": "/m.gguf", "quantization": "Q8_0", "n_ctx": 64,
    "max_draft": 8, "max_sessions": 2, "flash_attn": False,
}  # fmt: skip


def test_the_vocabulary_facts_are_one_model_and_info_stays_flat_on_the_wire():
    info = InfoResponse(**INFO, **InfoResponse.vocabulary_fields(VOCAB))
    assert info.vocabulary() == VOCAB
    wire = json.loads(info.model_dump_json())
    assert "vocabulary" not in wire and "type" not in wire and "hash" not in wire
    assert wire["vocab_type"] == "bpe" and wire["vocab_hash"] == "ab" * 32
    assert wire["n_vocab"] == 300 and wire["bos_id"] == 1 and wire["eos_id"] == 2
    assert wire["add_bos"] is True and wire["add_eos"] is False
    assert wire["vocab_text_hashes"] == {"180": "x" * 32, "300": "y" * 32}
    # What a client reads back is the same facts.
    assert InfoResponse.model_validate(wire).vocabulary() == VOCAB


def test_an_older_verifiers_info_has_facts_that_only_compare_as_the_same():
    old = {**INFO, "n_vocab": 300, "bos_id": 1, "eos_id": 2, "add_bos": True}
    facts = InfoResponse.model_validate({**old, "vocab_hash": "cd" * 32}).vocabulary()
    assert facts.type == "" and facts.add_eos is False and facts.text_hashes == {}
