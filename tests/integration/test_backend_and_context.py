"""Where the verifier computes and how much context it gives, as a new user meets them:
GPU layers asked of a CPU build stop the start naming the rebuild; with no context set,
a session gets the model's trained context, and a prompt of most of it is answered."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from scripts.harness.local import LocalVerifier, free_port
from server.shared.runtime import LlamaVocab, supports_gpu_offload
from tests.conftest import TEST_THREADS
from tests.fixtures.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.integration


@pytest.mark.skipif(supports_gpu_offload(), reason="this build has a GPU")
def test_gpu_layers_asked_of_a_cpu_build_stop_the_start_naming_the_rebuild(verifier_model):
    started = subprocess.run(
        [sys.executable, "-m", "uvicorn", "server.main:app", "--port", str(free_port())],
        env={
            **os.environ,
            "VERIFIER_MODEL_PATH": str(verifier_model),
            "VERIFIER_N_GPU_LAYERS": "-1",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode != 0
    message = " ".join(started.stderr.split())
    assert "VERIFIER_N_GPU_LAYERS=-1 asks for a GPU" in message
    assert 'CMAKE_ARGS="-DGGML_CUDA=on" ./scripts/setup.sh' in message
    assert "verifier ready" not in message


def started(model, **env: str) -> LocalVerifier:
    """The verifier as a new user starts it: no context set (one session, to keep the
    tests' memory small: the context is per session), its ready line logged."""
    verifier = LocalVerifier(
        {
            "VERIFIER_MODEL_PATH": str(model),
            "VERIFIER_N_THREADS": str(TEST_THREADS),
            "VERIFIER_MAX_SESSIONS": "1",
            **env,
        },
        extra_args=("--log-level", "info"),
    )
    try:
        verifier.wait_ready()
    except Exception:
        verifier.stop()
        raise
    return verifier


@pytest.fixture(scope="module")
def default_verifier(verifier_model):
    verifier = started(verifier_model)
    yield verifier
    verifier.stop()


def trained_context(model) -> int:
    vocab = LlamaVocab(model, vocab_only=True)
    try:  # a vocabulary alone has no hyperparameters: the GGUF's own key
        return int(vocab.metadata(f"{vocab.metadata('general.architecture')}.context_length"))
    finally:
        vocab.close()


def test_the_default_context_is_the_models_trained_one(default_verifier, verifier_model):
    info = httpx.get(f"{default_verifier.url}/info").json()
    trained = trained_context(verifier_model)
    assert (info["n_ctx_train"], info["context_source"]) == (trained, "trained")
    # Less the cells a session keeps past its context for the widest pass (a round of
    # max_draft + 1 rows, a prompt's stretch padded to a tile).
    assert trained - 64 <= info["n_ctx"] < trained
    log = default_verifier.log_path.read_text()
    assert f"sessions of {info['n_ctx']} tokens (the model's trained context)" in log
    assert "on CPU (" in log or info["gpu_layers"] > 0
    assert "training context overflow" not in log  # llama.cpp's warning past n_ctx_train


def long_prompt_answered(url: str, n_tokens: int, n_vocab: int) -> None:
    tokens = [(i * 7919) % (n_vocab - 10) + 5 for i in range(n_tokens)]
    opened = httpx.post(
        f"{url}/prefill", json={"prompt_tokens": tokens, "add_bos": False}, timeout=600
    )
    assert opened.status_code == 200, opened.text
    session = opened.json()["session_id"]
    verified = httpx.post(
        f"{url}/verify",
        json={"session_id": session, "n_past": len(tokens), "draft_tokens": []},
        timeout=60,
    )
    assert verified.status_code == 200 and verified.json()["total_tokens"] == len(tokens) + 1
    httpx.delete(f"{url}/sessions/{session}")


def test_a_prompt_longer_than_the_old_default_is_answered_and_one_too_long_named(
    default_verifier,
):
    """The real model: past the 2,048 tokens a session once held by default (the whole
    trained context costs minutes on a CPU: the tiny model below takes that)."""
    url = default_verifier.url
    info = httpx.get(f"{url}/info").json()
    long_prompt_answered(url, 2500, info["n_vocab"])
    over = httpx.post(
        f"{url}/prefill",
        json={"prompt_tokens": [100] * (info["n_ctx"] + 1), "add_bos": False},
        timeout=60,
    )
    assert over.status_code == 400
    message = over.json()["error"]["message"]
    assert "VERIFIER_N_CTX" in message and "VERIFIER_MAX_SESSIONS" in message


def test_a_prompt_of_most_of_the_trained_context_is_answered(tmp_path):
    """A model of the real architecture and trained context, tiny in width, so that the
    whole context is evaluated in seconds."""
    model = write_tiny_gguf(tmp_path / "tiny.gguf", context_length=8192)
    verifier = started(model)
    try:
        info = httpx.get(f"{verifier.url}/info").json()
        assert (info["context_source"], info["n_ctx_train"]) == ("trained", 8192)
        long_prompt_answered(verifier.url, 7800, info["n_vocab"])
    finally:
        verifier.stop()
