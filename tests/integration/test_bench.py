"""`scripts/bench.py --quick`: the benchmark runs end to end on the real models (a
verifier pinned to one core, the CLI to another, the delay proxy between them) and
every speculative run it measures is token-identical to the verifier alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from server.shared.defaults import REPO_ROOT

pytestmark = pytest.mark.integration


def test_quick_bench_writes_its_table_and_plots(tmp_path):
    completed = subprocess.run(
        [sys.executable, "scripts/bench.py", "--quick", "--out-dir", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads((tmp_path / "bench.json").read_text())
    assert set(results["delays"]) == {"0.0", "20.0"}
    for delay, block in results["delays"].items():
        assert block["baseline_decode_tokens_per_s"] > block["baseline_tokens_per_s"] > 0
        # The proxy's added delay shows in the measured round trip.
        assert block["rtt_ms"] >= float(delay)
        labels = {(row["drafter"], row["k"]) for row in block["rows"].values()}
        assert labels == {
            (drafter, k)
            for drafter in ("model sequential", "model pipelined", "model speculative (4)", "ngram")
            for k in ("4", "auto")
        }
        for row in block["rows"].values():
            assert row["identical"], (delay, row)
            assert row["tokens_per_s"] > 0 and row["expected_tokens_per_s"] > 0
            assert row["decode_speedup"] > 0
            assert 0.0 <= row["acceptance"] <= 1.0
            assert row["overhead_ms"] >= float(delay)
            within = [row["hit_rate_within"][b] for b in ("1", "2", "4")]
            if row["drafter"] == "model speculative (4)":
                # Its answers were ranked every round it drafted ahead; a hit is an
                # answer among those it drafted for.
                assert row["hit_rate"] <= within[-1] <= 1.0
            elif row["drafter"] == "model pipelined":
                # One answer drafted for, the one it ranks: every hit is that answer.
                assert row["hit_rate"] == within[0] == within[-1]
            else:
                assert row["hit_rate"] == within[-1] == 0.0  # never drafts ahead
    table = (tmp_path / "bench.md").read_text()
    # Two tables (pooled, then per task): a header and one row per config and delay each;
    # then the paper table: a header and one row per speculative config and delay.
    assert table.count("\n| ") == 2 * (1 + 2 * 8) + (1 + 2 * 2)
    assert "On paper" in table
    for png in ("speedup_vs_k.png", "speedup_vs_delay.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_token_time_bench_times_every_path_on_the_same_tokens(tmp_path):
    """`scripts/bench_token_time.py --quick`: every path of a token timed, and those that
    return their tokens (in process, the engine, /verify chunks) give the same ones."""
    out = tmp_path / "token_time.json"
    completed = subprocess.run(
        [sys.executable, "scripts/bench_token_time.py", "--quick", "--json", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report) == {"decode, in process", "engine, in process", "/verify chunks", "serve"}
    assert all(row["median_ms"] > 0 for row in report.values())
    for path in ("engine, in process", "/verify chunks"):
        assert report[path]["same_tokens"] is True, path
    assert "| serve |" in completed.stdout
