"""A request's prompts as `serve` makes them ready. The default pair has no
fill-in-the-middle tokens, so the frame for a model that has them is checked here with a
stand-in vocabulary (the real models' refusal is in tests/integration/test_openai_api.py)."""

from __future__ import annotations

import pytest

from drafter.serve.chat_api import CompletionRequest
from drafter.serve.errors import OpenAIError
from drafter.serve.prompts import TextSide, completion_prompts

PRE, SUF, MID, BOS = 900, 901, 902, 1


class Vocab:
    """Each character is a token (its code point)."""

    bos_id, add_bos = BOS, True

    def __init__(self, fim):
        self.fim_ids = fim

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return [BOS] * add_special + [ord(c) for c in text]


def model(fim=(PRE, SUF, MID)) -> TextSide:
    return TextSide(Vocab(fim), lambda t: chr(t).encode(), "stand-in")  # type: ignore[arg-type]


def test_a_suffix_is_framed_as_llama_cpps_server_frames_fill_in_the_middle():
    (text,) = completion_prompts(model(), CompletionRequest(prompt="ab", suffix="z"), 1000)
    assert text.verifier_input.prompt_tokens == [BOS, PRE, 97, 98, SUF, 122, MID]
    assert text.prompt_ids == text.verifier_input.prompt_tokens
    (ids,) = completion_prompts(model(), CompletionRequest(prompt=[99], suffix="z"), 1000)
    assert ids.verifier_input.prompt_tokens == [BOS, PRE, 99, SUF, 122, MID]


def test_a_suffix_without_fill_in_the_middle_tokens_is_a_400_naming_the_model():
    with pytest.raises(OpenAIError) as refused:
        completion_prompts(model(fim=None), CompletionRequest(prompt="ab", suffix="z"), 1000)
    assert refused.value.param == "suffix" and "stand-in" in refused.value.message


def test_prompt_forms_and_echo():
    request = CompletionRequest(prompt=["ab", "c"], echo=True)
    first, second = completion_prompts(model(), request, n_vocab=1000)
    assert first.verifier_input.prompt == "ab" and first.prompt_ids == [BOS, 97, 98]
    assert (first.echo, second.echo) == ("ab", "c")
    (ids,) = completion_prompts(model(), CompletionRequest(prompt=[104, 105], echo=True), 1000)
    assert ids.verifier_input.prompt_tokens == [104, 105] and ids.echo == "hi"


def test_token_ids_outside_the_verifiers_vocabulary_are_refused():
    with pytest.raises(OpenAIError) as refused:
        completion_prompts(model(), CompletionRequest(prompt=[[5], [1000]]), n_vocab=1000)
    assert refused.value.code == "invalid_token" and "1000" in refused.value.message
