"""Model pairs whose vocabularies are not identical, as families ship them: a verifier
padded with [PAD] tokens (Qwen2.5's 151,936 against 152,064), a drafter padded the other
way, and a drafter with one ordinary token spelled otherwise. Copies of the default models
written with `gguf` (tests/fixtures/vocab_gguf.py); real uvicorn, the real CLI."""

from __future__ import annotations

import json

import httpx
import pytest
from typer.testing import CliRunner

from drafter.cli import app
from drafter.client import VerifierClient
from drafter.drafters.model import DraftModel
from drafter.speculative.loop import SpeculativeLoop
from server.shared.protocol import PrefillRequest, VerifyRequest, VerifyResponse
from tests.conftest import TEST_N_CTX, TEST_THREADS, start_verifier
from tests.fixtures.vocab_gguf import write_vocab_variant

pytestmark = pytest.mark.integration

VERIFIER_PADDING = 64
DRAFTER_PADDING = 96
PROMPTS = ["The rules of chess say that", "def fibonacci(n):\n", "Shopping list:\n1."]
CHAT_PROMPT = "Name three rivers in Europe."
NEW_TOKENS = 24
runner = CliRunner()


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("vocab-pairs")


@pytest.fixture(scope="module")
def padded_verifier(verifier_model, models_dir):
    path = write_vocab_variant(
        verifier_model,
        models_dir / "verifier-padded.gguf",
        pad_tokens=VERIFIER_PADDING,
        name="SmolLM2 135M padded",
    )
    verifier = start_verifier(path)
    yield verifier
    verifier.stop()


@pytest.fixture(scope="module")
def padded_drafter(drafter_model, models_dir):
    return write_vocab_variant(
        drafter_model, models_dir / "drafter-padded.gguf", pad_tokens=DRAFTER_PADDING
    )


@pytest.fixture(autouse=True)
def own_vocab_cache(tmp_path_factory, monkeypatch):
    """The verifier's vocabulary cached where the tests can see it, not in ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))


def generate(url: str, prompt: str) -> list[int]:
    response = httpx.post(
        f"{url}/generate", json={"prompt": prompt, "max_tokens": NEW_TOKENS}, timeout=120
    )
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def run_cli(url: str, model, *args: str) -> dict:
    """The CLI with a fixed k: these pairs are about how drafts travel, and `auto` would
    not draft on this CPU, where drafts cannot pay."""
    result = runner.invoke(
        app,
        [
            "--server", url, "--model", str(model), "--max-tokens", str(NEW_TOKENS),
            "--output", "json", "--threads", str(TEST_THREADS), "--baseline",
            "--draft-n", "4", *args,
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_a_padded_verifier_decodes_exactly_as_the_original(padded_verifier, live_verifier):
    info = httpx.get(f"{padded_verifier.url}/info").json()
    original = httpx.get(f"{live_verifier.url}/info").json()
    assert info["n_vocab"] == original["n_vocab"] + VERIFIER_PADDING
    assert info["vocab_type"] == original["vocab_type"] == "bpe"
    assert str(original["n_vocab"]) in info["vocab_text_hashes"]
    for prompt in PROMPTS:
        assert generate(padded_verifier.url, prompt) == generate(live_verifier.url, prompt)


@pytest.mark.parametrize("chat", [False, True])
def test_the_original_drafter_drafts_ids_directly_for_a_padded_verifier(
    padded_verifier, drafter_model, chat
):
    prompts = [CHAT_PROMPT] if chat else PROMPTS
    for prompt in prompts:
        out = run_cli(
            padded_verifier.url, drafter_model, "--prompt", prompt, *(["--chat"] if chat else [])
        )
        assert out["vocab"] == "compatible"
        assert out["baseline"]["identical"] is True, prompt  # /generate's own tokens
        assert out["stats"]["accepted"] > 0  # drafts were taken: ids mean the same


def test_a_padded_drafter_drafts_for_the_original_verifier_and_sends_only_its_ids(
    live_verifier, padded_drafter
):
    out = run_cli(live_verifier.url, padded_drafter, "--prompt", PROMPTS[0])
    assert out["vocab"] == "compatible" and out["baseline"]["identical"] is True
    # Every draft token sent, recorded on the way out: none beyond the verifier's ids.
    n_vocab = httpx.get(f"{live_verifier.url}/info").json()["n_vocab"]
    sent: list[int] = []

    class Recording(VerifierClient):
        def verify(self, request: VerifyRequest) -> VerifyResponse:
            sent.extend(request.draft_tokens)
            return super().verify(request)

    model = DraftModel(padded_drafter, n_ctx=TEST_N_CTX + 256, n_threads=TEST_THREADS)
    try:
        assert model.n_vocab == n_vocab + DRAFTER_PADDING
        model.draft_for(n_vocab, "compatible")
        with Recording(live_verifier.url) as client:
            loop = SpeculativeLoop(model, client, draft_n=4, n_ctx=TEST_N_CTX)
            for prompt in PROMPTS:
                model.reset()
                list(loop.run(PrefillRequest(prompt=prompt), NEW_TOKENS))
                assert loop.result.tokens == generate(live_verifier.url, prompt)
    finally:
        model.close()
    assert sent and max(sent) < n_vocab


@pytest.fixture(scope="module")
def renamed_drafter(drafter_model, models_dir):
    return write_vocab_variant(
        drafter_model,
        models_dir / "drafter-renamed.gguf",
        renamed={1000: "\u0120zzzyzx".encode()},
        name="SmolLM2 135M renamed",
    )


def test_one_ordinary_token_spelled_otherwise_drafts_through_text(live_verifier, renamed_drafter):
    out = run_cli(live_verifier.url, renamed_drafter, "--prompt", PROMPTS[0])
    assert out["vocab"] == "translated"
    assert out["baseline"]["identical"] is True
    assert out["stats"]["accepted"] > 0


def test_with_no_translate_that_pair_is_refused_naming_both_models(live_verifier, renamed_drafter):
    result = runner.invoke(
        app,
        ["--server", live_verifier.url, "--model", str(renamed_drafter), "--prompt", "hi",
         "--no-translate"],
    )  # fmt: skip
    assert result.exit_code == 3
    message = " ".join(result.output.split())
    assert "vocabulary mismatch" in message and "token texts of ids 5 to" in message
    assert "SmolLM2 135M renamed" in message and "drafter-renamed.gguf" in message
    assert "smollm2-135m-instruct-q8_0.gguf" in message
