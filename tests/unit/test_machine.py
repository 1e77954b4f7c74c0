"""What a machine lends a model: the context each session gets from a KV budget, the
memory free for it, and where llama.cpp puts a model's layers on the devices it lists."""

from __future__ import annotations

import pytest

from server.shared.devices import Device, list_devices, placement
from server.shared.machine import (
    CONTEXT_STEP,
    FALLBACK_CONTEXT,
    available_memory,
    session_context,
)
from server.shared.runtime import supports_gpu_offload

KV = 23_040  # SmolLM2-135M: 30 layers x 2 x 3 heads x 64 x 2 bytes


def context(**over):
    facts = {
        "asked": 0,
        "n_ctx_train": 8192,
        "kv_bytes_per_token": KV,
        "n_sessions": 8,
        "budget_bytes": 8 * 8192 * KV * 2,
        "room": 64,
    }
    return session_context(**(facts | over))


def test_the_setting_is_taken_as_it_is():
    assert (context(asked=1024).n_ctx, context(asked=1024).source) == (1024, "asked")
    assert context(asked=100_000).n_ctx == 100_000


def test_the_trained_context_where_the_budget_holds_every_session_of_it():
    # Less the room each session keeps for its widest pass: no position past the trained.
    assert (context().n_ctx, context().source) == (8192 - 64, "trained")
    exact = 8 * 8192 * KV
    assert context(budget_bytes=exact).source == "trained"
    assert context(budget_bytes=exact - 1).source == "budget"


def test_a_smaller_budget_gives_the_most_that_fits_and_fewer_sessions_more_each():
    budget = 8 * 3000 * KV
    eight = context(budget_bytes=budget)
    assert eight.source == "budget" and eight.n_ctx % CONTEXT_STEP == 0
    assert 8 * (eight.n_ctx + 64) * KV <= budget < 8 * (eight.n_ctx + CONTEXT_STEP + 64) * KV
    two = context(budget_bytes=budget, n_sessions=2)
    assert two.source == "trained"  # a quarter of the sessions: the trained context fits
    assert context(budget_bytes=budget, n_sessions=4).n_ctx > eight.n_ctx


def test_never_less_than_the_fallback_and_never_more_than_trained():
    assert context(budget_bytes=1).n_ctx == FALLBACK_CONTEXT
    assert context(budget_bytes=1, n_ctx_train=512).n_ctx == 512 - 64
    assert context(n_ctx_train=0, room=0).n_ctx == FALLBACK_CONTEXT  # a model that does not say
    assert context(budget_bytes=0).source == "trained"  # no figure for the memory


def test_available_memory_reads_linux_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemFree: 10 kB\nMemAvailable:  2048 kB\n")
    assert available_memory(meminfo) == 2048 * 1024
    assert available_memory(tmp_path / "absent") > 0  # the physical memory instead


def device(kind: str, backend: str = "CUDA", name: str = "NVIDIA H200") -> Device:
    return Device(f"{backend}0", backend, name, kind, free_bytes=1, total_bytes=2)


CPU = Device("CPU", "CPU", "Intel Xeon", "cpu", 1, 2)


@pytest.mark.parametrize(
    ("found", "asked", "expected"),
    [
        ([CPU], -1, ("CPU", "Intel Xeon", 0)),  # a CPU build: nothing offloaded
        ([CPU, device("gpu")], 0, ("CPU", "Intel Xeon", 0)),
        ([CPU, device("gpu")], -1, ("CUDA", "NVIDIA H200", 31)),  # 30 blocks + output
        ([CPU, device("gpu")], 999, ("CUDA", "NVIDIA H200", 31)),
        ([CPU, device("gpu")], 10, ("CUDA", "NVIDIA H200", 10)),
        ([CPU, device("igpu", "Metal", "Apple M3 Max")], -1, ("Metal", "Apple M3 Max", 31)),
    ],
)
def test_placement_counts_layers_as_llama_cpp_does(found, asked, expected):
    where = placement(found, asked, n_layer=30)
    assert (where.backend, where.device, where.gpu_layers) == expected
    assert where.describe().startswith(expected[0])


def test_this_build_lists_its_devices_and_a_cpu_build_no_gpu():
    found = list_devices()
    assert any(d.kind == "cpu" and d.description for d in found)
    assert any(d.is_gpu for d in found) == supports_gpu_offload()


def test_a_ratio_measured_on_a_busy_machine_says_so():
    from drafter.output import busy_note

    assert busy_note(load=2.0, cores=2) == ""  # the demo's own two processes
    assert busy_note(load=3.5, cores=2) == " (noisy: load 3.5 on 2 cores while it ran)"
