"""The draft_token_generator CLI, in process (typer's CliRunner) against a real verifier."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from drafter.cli import app
from server.shared.runtime import supports_gpu_offload
from tests.conftest import TEST_THREADS
from tests.fixtures.tiny_gguf import write_tiny_gguf

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [*args, "--threads", str(TEST_THREADS)])


def test_help_gives_every_option_a_sentence_and_its_whole_default():
    result = runner.invoke(
        app, ["--help"], env={"COLUMNS": "80"}, prog_name="draft_token_generator"
    )
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())  # wrapped at 80 columns: join the lines
    command = typer.main.get_command(app)
    for param in command.params:
        sentence = (param.help or "").split("  [default:")[0]
        assert sentence.endswith((".", ".)")), param.name  # a whole sentence each
        assert param.opts[0] in text
    assert "--dgx" not in text
    assert "[default: http://127.0.0.1:8000]" in text  # defaults are not cut off
    assert "[default: models/smollm2-135m-instruct-q4_k_m.gguf]" in text
    assert "(required to generate)" in text
    assert "Usage: draft_token_generator [OPTIONS] [serve [OPTIONS]]" in text
    assert "…" not in text and "..." not in text.split("Commands:")[1]


def test_prompt_is_required():
    result = runner.invoke(app, ["--server", "http://127.0.0.1:9"])
    assert result.exit_code != 0
    assert "prompt" in result.output.lower()


def test_a_mistyped_variable_stops_the_cli_naming_the_one_meant(monkeypatch):
    monkeypatch.setenv("DRAFTER_SERVR", "http://127.0.0.1:9")
    result = runner.invoke(app, ["--prompt", "hi"])
    assert result.exit_code == 2
    assert "DRAFTER_SERVR is not a setting; did you mean DRAFTER_SERVER?" in result.output
    assert "Value error" not in result.output


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


def test_a_verifier_not_running_is_named_at_once_without_urllib3_noise():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        result = invoke("--server", url, "--prompt", "hi")  # the default retries
    assert result.exit_code == 1
    message = " ".join(result.output.split())
    assert f"the verifier at {url} cannot be reached" in message
    assert "Is the verifier running there" in message
    assert "Retrying" not in result.output and "urllib3" not in result.output


def test_a_prompt_longer_than_the_context_is_refused_before_any_decode(live_verifier):
    """In a process of its own: llama.cpp writes its complaints to the file descriptor,
    past any Python capture."""
    script = Path(sys.executable).parent / "draft_token_generator"
    long_prompt = "the cat sat on the mat and " * 400  # thousands of tokens; n_ctx is 1024
    result = subprocess.run(
        [str(script), "--server", live_verifier.url, "--prompt", long_prompt, "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "the verifier's context holds 1024 tokens" in " ".join(result.stderr.split())
    assert "decode" not in result.stdout + result.stderr
    assert "llama" not in result.stderr.replace("llama.cpp", "")


def test_missing_model_file_is_a_clear_error(live_verifier, tmp_path):
    result = invoke(
        "--server", live_verifier.url, "--model", str(tmp_path / "none.gguf"), "--prompt", "hi"
    )
    assert result.exit_code == 1
    assert "model file not found" in " ".join(result.output.split())


@pytest.mark.skipif(supports_gpu_offload(), reason="this build has a GPU")
def test_gpu_layers_asked_of_a_cpu_build_name_the_rebuild(live_verifier):
    result = invoke("--server", live_verifier.url, "--n-gpu-layers", "-1", "--prompt", "hi")
    assert result.exit_code == 1
    message = " ".join(result.output.split())
    assert "built without GPU support" in message and "CMAKE_ARGS" in message


def test_the_status_names_where_each_model_computes(live_verifier):
    result = invoke("--server", live_verifier.url, "--prompt", "hi", "--max-tokens", "2")
    assert result.exit_code == 0, result.output
    assert "draft model on CPU (" in result.output and "verifier on CPU (" in result.output


def live_verifier_info(verifier) -> dict:
    import httpx

    return httpx.get(f"{verifier.url}/info").json()
