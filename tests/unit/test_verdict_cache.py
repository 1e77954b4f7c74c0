"""The startup probe's verdicts kept between starts: a start on the same inputs takes them
and decodes only its timed passes; any input changed is another key; a file of another
shape, or none, means probing. On the fake runtime (its decodes counted)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from server.verifier.decoding.decoder import PassDecoder
from server.verifier.probe import invariance
from server.verifier.probe.round_probe import InvarianceReport
from server.verifier.probe.verdict_cache import VerdictCache, cache_key, restored, stored
from tests.fixtures.fake_runtime import FakeRuntime, switches_by_rows
from tests.fixtures.stepped import core_settings

FACTS = {"model": ["m.gguf", 1, 2], "build": ["0.3.36"], "cpu": ["x86_64", "EPYC", "avx2"]}


def probed(runtime: FakeRuntime, cache: VerdictCache | None, **settings):
    """probe_engine's report and shapes, and how many decodes the runtime made for them."""
    before = len(runtime.decodes)
    decoder = PassDecoder(runtime)  # type: ignore[arg-type]
    report, shapes = invariance.probe_engine(
        decoder, core_settings(max_draft=6, **settings), True, cache
    )
    return report, shapes, len(runtime.decodes) - before


def test_a_second_start_takes_the_verdicts_and_only_times_its_passes(tmp_path: Path):
    runtime = FakeRuntime(n_seq_max=4, n_batch=64, n_ctx_per_seq=256)
    cache = VerdictCache(tmp_path, FACTS)
    first, first_shapes, probing = probed(runtime, cache)
    assert len(list(tmp_path.glob("*.json"))) == 1
    again, shapes, timing = probed(runtime, cache)
    assert 0 < timing < probing / 3  # the contexts filled and the passes timed, no checks
    assert replace(again, pass_s=(), pass_cost_rows=0.0) == replace(
        first, pass_s=(), pass_cost_rows=0.0
    )
    assert len(again.pass_s) == 3  # measured on this start
    assert replace(shapes, pass_cost_rows=0.0) == replace(first_shapes, pass_cost_rows=0.0)
    assert all(not cells for cells in runtime.cells.values())  # every sequence left empty


def test_pinned_verdicts_are_taken_whole(tmp_path: Path):
    runtime = FakeRuntime(n_seq_max=4, n_batch=64, n_ctx_per_seq=256, kernel=switches_by_rows())
    cache = VerdictCache(tmp_path, FACTS)
    first, _, _ = probed(runtime, cache)
    assert first.pinned_width  # the kernels change with the rows: pinned
    again, _, decodes = probed(runtime, cache)
    assert decodes == 0 and again == first  # pinned shapes time no passes


def test_another_setting_or_fact_is_another_key(tmp_path: Path):
    runtime = FakeRuntime(n_seq_max=4, n_batch=64, n_ctx_per_seq=256)
    probed(runtime, VerdictCache(tmp_path, FACTS))
    _, _, decodes = probed(runtime, VerdictCache(tmp_path, FACTS), pin_shapes="off")
    assert decodes > 20 and len(list(tmp_path.glob("*.json"))) == 2
    _, _, decodes = probed(runtime, VerdictCache(tmp_path, {**FACTS, "build": ["0.3.37"]}))
    assert decodes > 20 and len(list(tmp_path.glob("*.json"))) == 3
    assert cache_key(FACTS) != cache_key({**FACTS, "cpu": ["x86_64", "EPYC", "avx512f"]})


def test_a_file_of_another_shape_or_none_means_probing(tmp_path: Path):
    runtime = FakeRuntime(n_seq_max=4, n_batch=64, n_ctx_per_seq=256)
    cache = VerdictCache(tmp_path, FACTS)
    probed(runtime, cache)
    (path,) = tmp_path.glob("*.json")
    for unreadable in (json.dumps({"batch_invariant": True}), "{half"):  # older; cut short
        path.write_text(unreadable)
        _, _, decodes = probed(runtime, cache)
        assert decodes > 20
        restored(json.loads(path.read_text()))  # written again, whole
    _, _, decodes = probed(runtime, None)
    assert decodes > 20  # off: every start probes


def test_the_timed_passes_are_never_kept():
    report = InvarianceReport(True, 0.0, True, 8, pass_cost_rows=3.5, pass_s=((1, 0.01),))
    fields = stored(report)
    assert "pass_s" not in fields and "pass_cost_rows" not in fields
    assert restored(json.loads(json.dumps(fields))) == replace(
        report, pass_cost_rows=0.0, pass_s=()
    )


def test_a_runtime_without_a_model_file_keeps_nothing(tmp_path: Path):
    assert VerdictCache.of(str(tmp_path), FakeRuntime()) is None  # type: ignore[arg-type]
    assert VerdictCache.of("", FakeRuntime()) is None  # type: ignore[arg-type]


def test_a_value_of_another_type_or_another_users_file_is_never_taken(tmp_path: Path, monkeypatch):
    runtime = FakeRuntime(n_seq_max=4, n_batch=64, n_ctx_per_seq=256)
    cache = VerdictCache(tmp_path, FACTS)
    probed(runtime, cache)
    (path,) = tmp_path.glob("*.json")
    fields = json.loads(path.read_text())
    for name, wrong in (("batch_invariant", 1), ("pinned_width", True), ("max_abs_diff", "0")):
        path.write_text(json.dumps({**fields, name: wrong}))
        _, _, decodes = probed(runtime, cache)
        assert decodes > 20, name  # probed again, and written again whole
    monkeypatch.setattr("os.getuid", lambda: path.stat().st_uid + 1)
    _, _, decodes = probed(runtime, cache)
    assert decodes > 20  # a file this user did not write vouches for nothing
