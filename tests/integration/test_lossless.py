"""Greedy losslessness end to end: real GGUF models, a real uvicorn on 127.0.0.1, the CLI.

The drafter's tokens must equal the verifier decoding alone, checked two ways: the
server's /generate, and llama-cpp-python's own greedy decoding of the verifier file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from drafter.cli import app
from drafter.client import VerifierClient
from drafter.drafters.model import DraftModel
from drafter.speculative.loop import SpeculativeLoop
from server.shared.defaults import REPO_ROOT
from server.shared.protocol import PrefillRequest, SamplingParams
from tests.conftest import TEST_N_CTX, TEST_THREADS
from tests.fixtures.scripted_length import ScriptedLength
from tests.fixtures.speculate import speculate

pytestmark = pytest.mark.integration

NEW_TOKENS = 64

# (name, prompt, --chat): plain and chat; code, prose, lists, explanations.
PROMPTS = [
    ("plain-prose", "The history of the printing press begins", False),
    ("plain-code", "def quicksort(items):\n", False),
    ("plain-list", "Ingredients for pancakes:\n1.", False),
    ("plain-json", '{"name": "Ada Lovelace", "born":', False),
    ("chat-code", "Write a Python function that checks whether a number is prime.", True),
    ("chat-prose", "Describe a rainy afternoon in a small town.", True),
    ("chat-list", "List five animals that live in the ocean.", True),
    ("chat-explain", "Explain what a hash table is.", True),
    ("chat-short", "Say yes.", True),
]

runner = CliRunner()


def run_cli(
    url: str, prompt: str, chat: bool, draft_n: int | str, max_tokens: int, *extra: str
) -> dict:
    args = [
        "--server",
        url,
        "--prompt",
        prompt,
        "--draft-n",
        str(draft_n),
        *extra,
        "--max-tokens",
        str(max_tokens),
        "--output",
        "json",
        "--threads",
        str(TEST_THREADS),
    ]
    if chat:
        args.append("--chat")
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def eog_ids(reference) -> set[int]:
    return reference.eog_ids


@pytest.fixture(scope="module")
def expected(live_verifier, reference):
    """Per prompt: its ids, /generate's tokens and the independent reference's tokens."""
    table = {}
    for name, prompt, chat in PROMPTS:
        out = run_cli(live_verifier.url, prompt, chat, draft_n=0, max_tokens=1)
        prompt_ids = out["prompt_ids"]
        generated = httpx.post(
            f"{live_verifier.url}/generate",
            json={"prompt_tokens": prompt_ids, "max_tokens": NEW_TOKENS},
            timeout=120,
        ).json()["tokens"]
        table[name] = (prompt_ids, generated, reference.greedy(prompt_ids, NEW_TOKENS))
    return table


def test_generate_equals_the_independent_reference(expected):
    for name, (_, generated, reference_tokens) in expected.items():
        assert generated == reference_tokens, name


def committed_by_rounds(stats: dict) -> int:
    """Accepted drafts and one token a drafted round; a round without a draft brings its
    own (one, or a chunk of the verifier's)."""
    drafted_rounds = stats["rounds"] - stats["rounds_without_draft"]
    return stats["accepted"] + drafted_rounds + stats["tokens_without_draft"]


@pytest.mark.parametrize("draft_n", [1, 4, 8])
@pytest.mark.parametrize(("name", "prompt", "chat"), PROMPTS, ids=[p[0] for p in PROMPTS])
def test_speculative_equals_verifier_alone(
    live_verifier, expected, eog_ids, name, prompt, chat, draft_n
):
    prompt_ids, generated, reference_tokens = expected[name]
    out = run_cli(live_verifier.url, prompt, chat, draft_n, NEW_TOKENS)
    assert out["prompt_ids"] == prompt_ids
    assert out["tokens"] == generated == reference_tokens
    if out["tokens"][-1] in eog_ids:
        assert out["finish_reason"] == "eos"
        assert eog_ids.isdisjoint(out["tokens"][:-1])
    else:
        assert len(out["tokens"]) == NEW_TOKENS
        assert out["finish_reason"] == "max_tokens"
    stats = out["stats"]
    assert stats["drafted"] <= draft_n * stats["rounds"]
    assert stats["generated_tokens"] == committed_by_rounds(stats)


# Drafts of several lengths and rounds without a draft (chunks of the verifier's own
# tokens, one token, nine) in turn: what `auto` may switch between at any round.
EVERY_KIND_OF_ROUND = [(0, 5), (3, 1), (0, 2), (1, 1), (0, 1), (6, 1), (0, 9), (2, 1)]


@pytest.mark.parametrize("pipeline", [False, True], ids=["sequential", "pipelined"])
@pytest.mark.parametrize("name", ["plain-code", "plain-list", "chat-list"])
def test_rounds_of_every_kind_in_turn_equal_the_verifier_alone(
    live_verifier, drafter_model, expected, name, pipeline
):
    prompt_ids, generated, reference_tokens = expected[name]
    request = PrefillRequest(prompt_tokens=prompt_ids, add_bos=False)
    rounds, result = speculate(
        live_verifier.url,
        drafter_model,
        request,
        NEW_TOKENS,
        ScriptedLength(EVERY_KIND_OF_ROUND),
        pipeline,
    )
    assert result.tokens == generated == reference_tokens
    chunks = [r for r in rounds if not r.draft_tokens and len(r.tokens) > 1]
    assert chunks, "no round brought a chunk"
    stats = result.stats.as_dict()
    assert stats["generated_tokens"] == committed_by_rounds(stats)


# Each speed feature on its own and together; pipelining is on by default above.
SPEED_CONFIGS = {
    "sequential": ("4", "--no-pipeline"),
    "adaptive": ("auto",),
    "adaptive-sequential": ("auto", "--no-pipeline"),
    "ngram": ("8", "--drafter", "ngram"),
    "model+ngram": ("auto", "--drafter", "model+ngram"),
    "suffix": ("auto", "--drafter", "suffix"),
    "model+suffix": ("auto", "--drafter", "model+suffix"),
    "model+history": ("auto", "--drafter", "model+history"),
    "p-min": ("8", "--p-min", "0.5"),
}
SPEED_PROMPTS = [
    p for p in PROMPTS if p[0] in ("plain-code", "plain-list", "chat-code", "chat-list")
]


@pytest.mark.parametrize("config", list(SPEED_CONFIGS))
@pytest.mark.parametrize(
    ("name", "prompt", "chat"), SPEED_PROMPTS, ids=[p[0] for p in SPEED_PROMPTS]
)
def test_speed_features_keep_the_output_identical(
    live_verifier, expected, name, prompt, chat, config
):
    draft_n, *extra = SPEED_CONFIGS[config]
    out = run_cli(live_verifier.url, prompt, chat, draft_n, NEW_TOKENS, *extra)
    assert out["tokens"] == expected[name][1] == expected[name][2]
    stats = out["stats"]
    assert stats["generated_tokens"] == committed_by_rounds(stats)
    if "--no-pipeline" in extra or "ngram" in extra or "suffix" in extra:
        assert stats["reused_drafts"] == 0


def test_pipelining_reuses_the_drafts_made_while_a_round_was_out(live_verifier, reference):
    """A text the draft model predicts well: guesses come true, and their drafts are sent
    without being drafted again, with the output still the verifier's alone."""
    prompt = "one two three four five six seven eight nine ten " * 3 + "one two"
    out = run_cli(live_verifier.url, prompt, False, 4, 48, "--pipeline")
    assert out["tokens"] == reference.greedy(out["prompt_ids"], 48)
    assert out["stats"]["reused_drafts"] > 0
    assert out["stats"]["acceptance_rate"] > 0.5


def test_the_suffix_drafter_drafts_a_repeated_request_from_the_users_history(
    unsized_verifier, reference, tmp_path
):
    """The second time a request comes, its whole answer is in the history file the first
    one left: most of it is drafted and accepted, and the output is the verifier's. (A
    fixed draft length and lookups verified whole: what `auto` and a sizing verifier
    choose follows measured times.)"""
    history = tmp_path / "history.jsonl"
    prompt = "Write a haiku about the sea."
    runs = [
        run_cli(unsized_verifier.url, prompt, True, 8, 40, "--drafter", "suffix",
                "--history-file", str(history))
        for _ in range(2)
    ]  # fmt: skip
    for out in runs:
        assert out["tokens"] == reference.greedy(out["prompt_ids"], 40)
    first, second = (out["stats"] for out in runs)
    assert history.read_text().count("\n") == 2  # each generation appended
    assert second["accepted"] > first["accepted"]
    assert second["accepted"] >= second["generated_tokens"] // 2  # most of it drafted


def test_some_prompts_end_with_eos_and_others_run_to_max_tokens(expected, eog_ids):
    endings = {name: tokens[-1] in eog_ids for name, (_, tokens, _) in expected.items()}
    assert any(endings.values()) and not all(endings.values()), endings


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 9])
def test_max_tokens_is_met_exactly(live_verifier, expected, max_tokens):
    _, generated, _ = expected["plain-prose"]
    out = run_cli(live_verifier.url, PROMPTS[0][1], False, 8, max_tokens)
    assert out["tokens"] == generated[:max_tokens]


def test_drafter_evaluates_only_new_tokens(live_verifier, drafter_model):
    """After the first round the drafter evaluates at most k + 1 tokens per round (the
    target's token, maybe the last draft, and k - 1 new drafts), at any context length."""
    draft_n = 4
    with VerifierClient(live_verifier.url) as client:
        model = DraftModel(drafter_model, n_ctx=TEST_N_CTX + 256, n_threads=TEST_THREADS)
        try:
            for words in (4, 600):
                loop = SpeculativeLoop(model, client, draft_n=draft_n, n_ctx=TEST_N_CTX)
                request = PrefillRequest(prompt=" ".join(["apple"] * words) + " banana")
                per_round = []
                before = model.decoded_tokens
                for _ in loop.run(request, 40):
                    per_round.append(model.decoded_tokens - before)
                    before = model.decoded_tokens
                prompt_len = loop.result.stats.prompt_tokens
                assert prompt_len > words
                assert per_round[0] <= prompt_len + draft_n
                assert max(per_round[1:]) <= draft_n + 1
        finally:
            model.close()


@pytest.mark.parametrize("chat", [False, True])
def test_warming_evaluates_the_prompt_the_verifier_will_hold(live_verifier, drafter_model, chat):
    """`warm` (run while the verifier prefills, when pipelined) tokenizes the prompt as the
    server does: the first draft then needs no decode of the prompt."""
    with VerifierClient(live_verifier.url) as client:
        model = DraftModel(drafter_model, n_ctx=TEST_N_CTX + 256, n_threads=TEST_THREADS)
        try:
            text = "Name three rivers of Europe."
            prompt = model.chat_prompt(text) if chat else text
            request = PrefillRequest(prompt=prompt, add_bos=not model.starts_with_bos(prompt))
            model.warm(request)
            warmed = model.decoded_tokens
            opened = client.prefill(request)
            assert warmed == len(opened.prompt_ids)
            model.get_candidates(opened.prompt_ids, 1)
            assert model.decoded_tokens == warmed
            client.delete_session(opened.session_id)
        finally:
            model.close()


def test_warm_up_times_a_draft_token_and_leaves_the_cache_empty(drafter_model):
    """What `serve` does as it starts: the draft model's weights read in, and the time of
    the decode a draft waits for after an answer kept as `auto`'s prior."""
    model = DraftModel(drafter_model, n_ctx=TEST_N_CTX + 256, n_threads=TEST_THREADS)
    try:
        assert model.context.draft_token_s is None
        model.warm_up()
        assert model.context.draft_token_s > 0
        assert model.cached_tokens == []
    finally:
        model.close()


def test_console_script_streams_text_and_stats(live_verifier):
    script = Path(sys.executable).parent / "draft_token_generator"
    env = {**os.environ, "DRAFTER_SERVER": live_verifier.url}
    completed = subprocess.run(
        [
            str(script),
            "--prompt",
            PROMPTS[1][1],
            "--max-tokens",
            "24",
            "--threads",
            str(TEST_THREADS),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO_ROOT,
    )
    assert completed.returncode == 0, completed.stderr
    text = httpx.post(
        f"{live_verifier.url}/generate", json={"prompt": PROMPTS[1][1], "max_tokens": 24}
    ).json()["text"]
    assert completed.stdout.startswith(text)
    assert "tokens per round" in completed.stdout


# Penalties and biases the verifier applies to its own rows (OpenAI's meaning): a token's
# logit gets its bias, loses the presence penalty once generated, the frequency penalty
# for each time.
ADJUSTED = {"presence_penalty": 0.6, "frequency_penalty": 0.4}


def naive_adjust(bias: dict[int, float]):
    def adjust(generated: list[int], scores: np.ndarray) -> np.ndarray:
        scores = scores.copy()
        for token, value in bias.items():
            scores[token] += value
        for token in set(generated):
            count = generated.count(token)
            scores[token] -= ADJUSTED["frequency_penalty"] * count + ADJUSTED["presence_penalty"]
        return scores

    return adjust


@pytest.mark.parametrize("name", ["plain-list", "chat-list"])
def test_penalties_and_biases_over_every_kind_of_round_equal_the_verifier_alone(
    live_verifier, drafter_model, expected, reference, name
):
    """Greedy under penalties and a bias: drafts of several lengths and chunks in turn
    give the verifier's own /generate under them, and an independent decoding (llama-cpp-
    python's, the adjustment written out naively in its logits hook)."""
    prompt_ids, plain, _ = expected[name]
    bias = {plain[1]: -100.0, plain[3]: 3.0}  # ban one token it wanted, push another
    sampling = SamplingParams(**ADJUSTED, logit_bias=bias)
    generated = httpx.post(
        f"{live_verifier.url}/generate",
        json={
            "prompt_tokens": prompt_ids,
            "max_tokens": NEW_TOKENS,
            "sampling": sampling.model_dump(mode="json"),
        },
        timeout=120,
    ).json()["tokens"]
    assert generated != plain
    assert generated == reference.greedy(prompt_ids, NEW_TOKENS, naive_adjust(bias))
    request = PrefillRequest(prompt_tokens=prompt_ids, add_bos=False, sampling=sampling)
    script = ScriptedLength(EVERY_KIND_OF_ROUND)
    rounds, result = speculate(live_verifier.url, drafter_model, request, NEW_TOKENS, script)
    assert result.tokens == generated
    assert any(r.accepted_prefix_len for r in rounds), "no draft was accepted"
