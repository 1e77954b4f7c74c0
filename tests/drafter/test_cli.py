"""The draft_token_generator CLI, in process (typer's CliRunner) against a real verifier."""

import json

import pytest
from typer.testing import CliRunner

from drafter.cli import app
from tests.conftest import TEST_THREADS
from tests.fixtures.tiny_gguf import write_tiny_gguf

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [*args, "--threads", str(TEST_THREADS)])


def test_help_lists_the_options():
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for option in (
        "--server",
        "--model",
        "--prompt",
        "--draft-n",
        "--max-tokens",
        "--chat",
        "--output",
        "--n-gpu-layers",
        "--baseline",
    ):
        assert option in result.stdout


def test_prompt_is_required():
    result = runner.invoke(app, ["--server", "http://127.0.0.1:9"])
    assert result.exit_code != 0
    assert "prompt" in result.output.lower()


def test_json_output_shape(live_verifier):
    result = invoke(
        "--server",
        live_verifier.url,
        "--prompt",
        "Name a colour:",
        "--max-tokens",
        "10",
        "--output",
        "json",
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert {"prompt_ids", "tokens", "text", "stats"} <= set(out)
    assert out["stats"]["generated_tokens"] == len(out["tokens"]) == 10
    assert out["stats"]["prompt_tokens"] == len(out["prompt_ids"])
    assert out["stats"]["bytes_sent"] > 0 and out["stats"]["bytes_received"] > 0
    assert 0.0 <= out["stats"]["acceptance_rate"] <= 1.0
    assert out["text"]


def test_text_mode_stats_block(live_verifier):
    result = invoke(
        "--server", live_verifier.url, "--prompt", "One, two, three,", "--max-tokens", "12"
    )
    assert result.exit_code == 0, result.output
    for label in (
        "prompt tokens",
        "generated tokens",
        "rounds",
        "drafted",
        "accepted",
        "acceptance rate",
        "tokens per round",
        "total time",
        "tokens/s",
        "bytes sent",
        "bytes received",
    ):
        assert label in result.stdout


def test_baseline_reports_a_measured_speedup(live_verifier):
    result = invoke(
        "--server",
        live_verifier.url,
        "--prompt",
        "The sky is",
        "--max-tokens",
        "16",
        "--baseline",
        "--output",
        "json",
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["baseline"]["identical"] is True
    assert out["baseline"]["tokens"] == out["tokens"]
    assert out["speedup"] == pytest.approx(
        out["stats"]["tokens_per_s"] / out["baseline"]["tokens_per_s"], rel=1e-3
    )


def test_vocabulary_mismatch_names_both_models(live_verifier, tmp_path):
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    result = invoke(
        "--server", live_verifier.url, "--model", str(tiny), "--prompt", "hi", "--no-translate"
    )
    assert result.exit_code == 3
    message = " ".join(result.output.split())
    assert "vocabulary mismatch" in message
    assert "tiny-test-llama" in message and "tiny.gguf" in message
    info = live_verifier_info(live_verifier)
    assert info["model"] in message
    assert "smollm2-135m-instruct-q8_0.gguf" in message


def test_unreachable_verifier_is_a_clear_error():
    result = invoke(
        "--server", "http://127.0.0.1:9", "--prompt", "hi", "--timeout", "2", "--retries", "1"
    )
    assert result.exit_code == 1
    assert "cannot reach the verifier" in " ".join(result.output.split())


def test_missing_model_file_is_a_clear_error(live_verifier, tmp_path):
    result = invoke(
        "--server", live_verifier.url, "--model", str(tmp_path / "none.gguf"), "--prompt", "hi"
    )
    assert result.exit_code == 1
    assert "model file not found" in " ".join(result.output.split())


def live_verifier_info(verifier) -> dict:
    import httpx

    return httpx.get(f"{verifier.url}/info").json()
