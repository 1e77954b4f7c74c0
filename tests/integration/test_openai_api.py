"""`draft_token_generator serve` with the official openai client, against a real verifier."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from scripts.harness.local import LocalServe
from tests.conftest import TEST_THREADS

pytestmark = pytest.mark.integration


class LocalAPI(LocalServe):
    def __init__(self, verifier_url: str, *extra: str):
        super().__init__(verifier_url, *extra, threads=TEST_THREADS)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local_api(live_verifier):
    api = LocalAPI(live_verifier.url)
    yield api
    api.log = api.stop()


def verifier_text(live_verifier, prompt: str, max_tokens: int) -> str:
    return httpx.post(
        f"{live_verifier.url}/generate",
        json={"prompt": prompt, "max_tokens": max_tokens},
        timeout=120,
    ).json()["text"]


CHAT_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def test_models_lists_the_verifier_model(local_api, live_verifier):
    models = local_api.client().models.list()
    assert len(models.data) == 1


def test_completion_equals_the_verifier_alone(local_api, live_verifier):
    prompt = "The three laws of motion are"
    result = local_api.client().completions.create(
        model="any", prompt=prompt, max_tokens=24, temperature=0
    )
    assert result.choices[0].text == verifier_text(live_verifier, prompt, 24)
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 24
    assert result.model_extra["speculative"]["rounds"] >= 1
    assert 0 <= result.model_extra["speculative"]["acceptance_rate"] <= 1


def test_streamed_completion_equals_the_verifier_alone(local_api, live_verifier):
    prompt = "def fibonacci(n):\n"
    stream = local_api.client().completions.create(
        model="any", prompt=prompt, max_tokens=30, temperature=0, stream=True
    )
    chunks = list(stream)
    assert len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks) == verifier_text(live_verifier, prompt, 30)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_completion_uses_the_chat_template(local_api, live_verifier):
    result = local_api.client().chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=40,
        temperature=0,
    )
    message = result.choices[0].message
    assert message.role == "assistant"
    assert message.content == verifier_text(live_verifier, CHAT_PROMPT, 40)
    assert result.usage.prompt_tokens > 5


def test_streamed_chat_completion(local_api, live_verifier):
    stream = local_api.client().chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=40,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == verifier_text(live_verifier, CHAT_PROMPT, 40)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_sequences_are_honoured(local_api, live_verifier):
    prompt = "Count: one, two, three, four, five, six,"
    full = verifier_text(live_verifier, prompt, 40)
    stop = full.strip().split()[2]
    assert stop in full
    for stream in (False, True):
        result = local_api.client().completions.create(
            model="any", prompt=prompt, max_tokens=40, temperature=0, stop=[stop], stream=stream
        )
        if stream:
            chunks = list(result)
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = result.choices[0].text, result.choices[0].finish_reason
        assert text == full[: full.index(stop)]
        assert finish == "stop"


def test_sampling_with_a_seed_is_reproducible(local_api):
    def once():
        return (
            local_api.client()
            .completions.create(
                model="any", prompt="Once upon a time", max_tokens=20, temperature=0.8, seed=5
            )
            .choices[0]
            .text
        )

    assert once() == once()


def test_errors_have_the_openai_shape(local_api):
    client = local_api.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="any", prompt="hi", max_tokens=0)
    assert bad.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="any", prompt="hi", n=2)
    with pytest.raises(openai.BadRequestError) as too_long:  # refused before taking a slot
        client.completions.create(model="any", prompt="word " * 1500, max_tokens=4)
    assert too_long.value.body["code"] == "context_length_exceeded"


def test_a_down_verifier_is_a_clear_error_not_a_hang():
    api = LocalAPI("http://127.0.0.1:9")
    try:
        began = time.monotonic()
        with pytest.raises(openai.APIStatusError) as error:
            api.client().completions.create(model="any", prompt="hi", max_tokens=4)
        assert time.monotonic() - began < 30
        assert error.value.status_code == 503
        assert error.value.body["code"] == "verifier_unavailable"
        assert "cannot reach the verifier" in error.value.body["message"]
    finally:
        api.stop()


def test_a_vocabulary_mismatch_is_a_clear_error(live_verifier, tmp_path):
    from tests.fixtures.tiny_gguf import write_tiny_gguf

    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    api = LocalAPI(live_verifier.url, "--model", str(tiny))
    try:
        with pytest.raises(openai.APIStatusError) as error:
            api.client().chat.completions.create(
                model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        assert error.value.status_code == 502
        assert error.value.body["code"] == "vocabulary_mismatch"
        assert "tiny-test-llama" in error.value.body["message"]
    finally:
        api.stop()
