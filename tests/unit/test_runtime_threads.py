"""`n_threads = 0` means the cores this process may use (not llama.cpp's fixed default),
on both sides: the verifier's runtime and the drafter's, which is the same class."""

from __future__ import annotations

import os

import pytest

from server.shared.runtime import LlamaRuntime, usable_cores
from tests.fixtures.tiny_gguf import write_tiny_gguf


@pytest.mark.parametrize("asked", [0, 1])
def test_zero_threads_means_the_usable_cores(tmp_path, asked):
    runtime = LlamaRuntime(
        write_tiny_gguf(tmp_path / "tiny.gguf"), n_ctx_per_seq=64, n_threads=asked
    )
    try:
        assert runtime.n_threads == (asked or usable_cores())
    finally:
        runtime.close()


def test_usable_cores_follow_the_affinity_without_a_quota(tmp_path):
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity API on this platform")
    assert usable_cores(tmp_path / "no-quota") == len(os.sched_getaffinity(0)) >= 1


@pytest.mark.parametrize(
    ("cpu_max", "limit"), [("max 100000\n", None), ("150000 100000\n", 2), ("50000 100000", 1)]
)
def test_a_cpu_quota_caps_the_usable_cores(tmp_path, cpu_max, limit):
    quota = tmp_path / "cpu.max"
    quota.write_text(cpu_max)
    unlimited = usable_cores(tmp_path / "absent")
    assert usable_cores(quota) == (unlimited if limit is None else min(unlimited, limit))


def test_a_pass_of_one_row_has_threads_of_its_own(tmp_path):
    runtime = LlamaRuntime(
        write_tiny_gguf(tmp_path / "tiny.gguf"), n_ctx_per_seq=64, n_threads=2, single_row_threads=1
    )
    try:
        assert (runtime.n_threads, runtime.single_row_threads) == (2, 1)
    finally:
        runtime.close()


@pytest.mark.parametrize(("n_gpu_layers", "on_gpu"), [(0, False), (8, False), (-1, True)])
def test_the_verifier_decodes_a_lone_row_with_one_thread_unless_a_gpu_runs_it(
    tmp_path, n_gpu_layers, on_gpu
):
    from server.shared.runtime import supports_gpu_offload
    from server.verifier.decoding.loading import single_row_threads
    from server.verifier.settings import VerifierSettings

    settings = VerifierSettings(
        model_path=write_tiny_gguf(tmp_path / "tiny.gguf"), n_gpu_layers=n_gpu_layers
    )
    assert single_row_threads(settings) == (0 if on_gpu and supports_gpu_offload() else 1)
