"""Gemma 3 270M (262,144 tokens, SentencePiece) drafting for the SmolLM2 verifier (49,152,
byte-level BPE) through text: the verifier's ids the only ones on the wire, its output
token for token. Gemma comes from PyPI in chunk packages, prepared once per run."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from drafter.cli import app
from tests.conftest import TEST_THREADS

pytestmark = pytest.mark.integration

PLAIN = [
    "The rules of chess say that",
    "def fibonacci(n):\n",
    "Shopping list:\n1.",
    "In 1969, the first humans",
]
CHAT = ["Name three rivers in Europe.", "What is the capital of France?"]
NEW_TOKENS = 24
runner = CliRunner()


@pytest.fixture(autouse=True)
def own_vocab_cache(tmp_path_factory, monkeypatch):
    """The verifier's vocabulary cached where the tests can see it, not in ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))


def run_cli(url: str, model: str, *args: str) -> dict:
    """The CLI with a fixed k (unless `args` give one): these tests are about translated
    drafts, and `auto` chooses by measured times whether to draft at all."""
    result = runner.invoke(
        app,
        [
            "--server", url, "--model", model, "--max-tokens", str(NEW_TOKENS),
            "--output", "json", "--threads", str(TEST_THREADS), "--draft-n", "4", *args,
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_gemma_drafts_for_smollm2_greedy_output_is_the_verifiers(live_verifier, gemma):
    accepted = drafted = 0
    cases = [(p, []) for p in PLAIN] + [(p, ["--chat"]) for p in CHAT]
    for prompt, extra in cases:
        out = run_cli(live_verifier.url, gemma, "--prompt", prompt, "--baseline", *extra)
        assert out["vocab"] == "translated"
        assert out["baseline"]["identical"] is True, prompt
        accepted += out["stats"]["accepted"]
        drafted += out["stats"]["drafted"]
    assert drafted > 0 and accepted > 0  # the translated drafts are taken, some of them


def test_sampling_through_text_verifies_with_match_reproducibly(live_verifier, gemma):
    args = ["--prompt", PLAIN[0], "--temperature", "0.8", "--seed", "11", "--baseline"]
    first = run_cli(live_verifier.url, gemma, *args)
    again = run_cli(live_verifier.url, gemma, *args)
    # Rejection sampling was asked for (the default at a temperature): `match` it is.
    assert first["strategy"] == "match" and first["lossless"] is True
    assert first["tokens"] == again["tokens"]
    assert first["baseline"]["identical"] is True  # the verifier alone, same seed


def test_a_prompt_longer_in_the_drafters_tokens_than_its_context_still_drafts(live_verifier, gemma):
    """ChatML markup is text to Gemma: several times as many tokens as the verifier's
    special tokens. The drafter keeps the tail that fits its context."""
    turns = "".join(
        f"<|im_start|>user\nsay {i}<|im_end|>\n<|im_start|>assistant\n{i}<|im_end|>\n"
        for i in range(40)
    )
    prompt = turns + "<|im_start|>user\nsay 40<|im_end|>\n<|im_start|>assistant\n"
    out = run_cli(live_verifier.url, gemma, "--prompt", prompt, "--baseline")
    assert 600 < out["stats"]["prompt_tokens"] < 900  # fits the verifier, not the drafter
    assert out["baseline"]["identical"] is True
    assert out["stats"]["drafted"] > 0
