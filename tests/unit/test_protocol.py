import pytest
from pydantic import ValidationError

from server.shared.protocol import (
    GenerateRequest,
    PrefillRequest,
    SamplingParams,
    VerifyRequest,
)
from server.shared.vocab import vocab_fingerprint


def test_prefill_needs_exactly_one_prompt():
    assert PrefillRequest(prompt="hi").prompt == "hi"
    assert PrefillRequest(prompt_tokens=[1, 2]).prompt_tokens == [1, 2]
    with pytest.raises(ValidationError):
        PrefillRequest()
    with pytest.raises(ValidationError):
        PrefillRequest(prompt="hi", prompt_tokens=[1])


@pytest.mark.parametrize("scope", ["", "a" * 65, "key-0 ", "k/0", "ключ", "a\n", 7])
def test_a_cache_scope_is_bounded_and_plain(scope):
    """An opaque name, never text to log or key anything by as given: 1 to 64 letters,
    digits, '-' or '_'."""
    with pytest.raises(ValidationError):
        PrefillRequest.model_validate({"prompt": "hi", "cache_scope": scope})


def test_a_cache_scope_travels_only_where_given():
    """An older verifier refuses fields it does not know: one without a scope sends none."""
    assert "cache_scope" not in PrefillRequest(prompt="hi").model_dump(mode="json")
    scoped = PrefillRequest.model_validate({"prompt": "hi", "cache_scope": "Ab-_09" * 10})
    assert scoped.model_dump(mode="json")["cache_scope"] == "Ab-_09" * 10


@pytest.mark.parametrize(
    "payload",
    [
        {"session_id": "s", "n_past": -1, "draft_tokens": []},
        {"session_id": "s", "n_past": 3, "draft_tokens": [-5]},
        {"session_id": "s", "n_past": 3, "draft_tokens": [1.5]},
        {"session_id": "s", "n_past": 3, "draft_tokens": list(range(257))},
        {"session_id": "", "n_past": 3},
        {"n_past": 3},
        {"session_id": "s", "n_past": 3, "unknown_field": 1},
    ],
)
def test_verify_rejects_bad_payloads(payload):
    with pytest.raises(ValidationError):
        VerifyRequest.model_validate(payload)


def test_verify_defaults_to_empty_draft():
    request = VerifyRequest(session_id="s", n_past=4)
    assert request.draft_tokens == []
    assert request.draft_probs is None


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -1}, {"seed": -3}],
)
def test_sampling_ranges(sampling):
    with pytest.raises(ValidationError):
        SamplingParams.model_validate(sampling)


def test_generate_needs_positive_max_tokens():
    with pytest.raises(ValidationError):
        GenerateRequest(prompt="x", max_tokens=0)


def test_vocab_fingerprint_sees_order_and_boundaries():
    base = vocab_fingerprint([b"a", b"bc"])
    assert base == vocab_fingerprint([b"a", b"bc"])
    assert base != vocab_fingerprint([b"bc", b"a"])
    assert base != vocab_fingerprint([b"ab", b"c"])  # lengths are hashed too
    assert base != vocab_fingerprint([b"a", b"bc", b""])
