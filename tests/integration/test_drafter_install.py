"""What a Mac installs: `pip install '.[drafter]'` in a fresh virtual environment drafts
against a verifier with none of the server's web stack importable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server.shared.defaults import REPO_ROOT
from tests.conftest import TEST_THREADS

pytestmark = pytest.mark.integration

WEB_STACK = ("fastapi", "starlette", "uvicorn", "prometheus_client", "sse_starlette")


@pytest.fixture(scope="module")
def drafter_only(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("drafter-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # This environment's pip installs into the new one: llama-cpp-python comes from the
    # wheel it built for ./scripts/setup.sh (its cache), the rest from the index.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--disable-pip-version-check",
            f"{REPO_ROOT}[drafter]",
        ],
        check=True,
        timeout=900,
    )
    return venv


def test_the_drafter_installs_and_runs_without_the_web_stack(drafter_only, live_verifier):
    python = drafter_only / "bin" / "python"
    for module in WEB_STACK:
        found = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True)
        assert found.returncode != 0, f"{module} is importable in the drafter's environment"
    cli = drafter_only / "bin" / "draft_token_generator"
    assert subprocess.run([str(cli), "--help"], capture_output=True).returncode == 0
    prompt = "The capital of France is"
    result = subprocess.run(
        [
            str(cli),
            "--server",
            live_verifier.url,
            "--prompt",
            prompt,
            "--max-tokens",
            "12",
            "--threads",
            str(TEST_THREADS),
            "--output",
            "json",
            "--model",
            str(REPO_ROOT / "models" / "smollm2-135m-instruct-q4_k_m.gguf"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    expected = httpx.post(
        f"{live_verifier.url}/generate", json={"prompt": prompt, "max_tokens": 12}, timeout=120
    ).json()["tokens"]
    assert json.loads(result.stdout)["tokens"] == expected
    serve = subprocess.run([str(cli), "serve"], capture_output=True, text=True, timeout=120)
    assert serve.returncode != 0 and "hetero-specdecode[serve]" in serve.stderr
