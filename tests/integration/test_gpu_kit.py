"""The GPU kit (scripts/gpu/) kept from rotting on a CPU: the model writer makes a GGUF
that llama.cpp loads and decodes with the default verifier's vocabulary, and the
measurement script's quickest form runs on it end to end (a real verifier, real replayed
drafters, every output checked against /generate), as it will on a GPU machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from server.shared.runtime import BatchEntry, LlamaRuntime
from server.verifier.decoding.vocab_file import vocab_only_gguf

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, verifier_model) -> Path:
    where = tmp_path_factory.mktemp("gpu-kit")
    vocab = where / "vocab.gguf"
    vocab.write_bytes(vocab_only_gguf(verifier_model))
    out = where / "tiny.gguf"
    subprocess.run(
        [sys.executable, "scripts/gpu/make_model.py", "--vocab", str(vocab), "--shape", "tiny",
         "--out", str(out)],
        cwd=ROOT, check=True, timeout=300,
    )  # fmt: skip
    return out


def test_the_random_model_loads_with_the_verifiers_vocabulary_and_decodes(
    tiny_model, verifier_model
):
    runtime = LlamaRuntime(tiny_model, n_ctx_per_seq=256, n_threads=1)
    reference = LlamaRuntime(verifier_model, n_ctx_per_seq=256, n_threads=1)
    try:
        assert (runtime.n_vocab, runtime.quantization) == (reference.n_vocab, "Q8_0")
        text = "The history of the bicycle begins"
        ids = runtime.tokenize(text, add_special=True)
        assert ids == reference.tokenize(text, add_special=True)
        logits = runtime.decode([BatchEntry(t, i, 0, True) for i, t in enumerate(ids)])
        assert logits.shape == (len(ids), runtime.n_vocab)
        assert np.isfinite(logits).all() and logits.std() > 0
    finally:
        runtime.close()
        reference.close()


def test_the_measurement_scripts_quickest_form_runs_and_finds_the_output_exact(
    tiny_model, tmp_path
):
    done = subprocess.run(
        [sys.executable, "scripts/gpu/measure.py", "--model", str(tiny_model), "--out",
         str(tmp_path), "--quick", "--gpu-layers", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = (tmp_path / "gpu-report.md").read_text()
    assert "failed" not in report and "incomplete" not in report, report
    for section in ("(a) The startup probe", "(c) One round", "(c) One pass", "(b, d)", "(e)"):
        assert section in report
    # The probe's checks one by one: free and pinned, short and long, all exact on the CPU.
    table = report.split("(a) Where rows move")[1].split("\n\n")[0].splitlines()
    rows = [line.split(" | ") for line in table if line.startswith(("| free", "| pinned"))]
    assert len(rows) == 4 and all(row[2] == "True" for row in rows), table
    table = report.split("(b, d)")[1].split("\n\n")[0].splitlines()
    rows = [line for line in table if line.startswith("| ") and "drafters" not in line]
    assert len(rows) == 4, table  # 1 and 2 drafters, k 4 and auto
    assert all(line.endswith("| 0 | yes |") for line in rows), table  # no error, exact
    assert (tmp_path / "gpu-report.json").exists()


@pytest.mark.parametrize("script", ["prepare_kit.sh", "run.sh"])
def test_the_kit_scripts_parse(script):
    subprocess.run(["bash", "-n", f"scripts/gpu/{script}"], cwd=ROOT, check=True)
