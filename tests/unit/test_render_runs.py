"""The measured runs are data (docs/runs/), and the docs' tables are rendered from them:
every rendered block of docs/performance.md and docs/architecture.md equals what
scripts/render_runs.py renders from the records, and the performance page holds no table
copied by hand."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scripts.render_runs import RUNS, check, load_machines, load_runs, main, write

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"id", "title", "date", "machine", "models", "commit", "commit_kind", "script"}
FIELDS |= {"commands", "setup", "tables", "notes"}


def test_the_pages_tables_are_the_records_rendered():
    assert check(ROOT / "docs" / "performance.md", strict=True) == []
    assert check(ROOT / "docs" / "architecture.md") == []


def test_every_record_is_whole():
    runs, machines = load_runs(), load_machines()
    assert len(runs) >= 40
    for run_id, run in runs.items():
        assert set(run) >= FIELDS, (run_id, FIELDS - set(run))
        assert run_id.startswith(run["date"]) and re.fullmatch(r"\d{4}-\d\d-\d\d", run["date"])
        assert run["machine"] in machines, run_id
        assert run["commit_kind"] in {"measured", "published"}, run_id
        named = [run["commit"]] if isinstance(run["commit"], str) else run["commit"]
        assert all(re.fullmatch(r"[0-9a-f]{7}", c) for c in named), run_id
        assert (ROOT / run["script"]).is_file(), run_id
        assert any(run["script"] in command for command in run["commands"]), run_id
        assert run["tables"] or run["notes"], f"{run_id}: neither tables nor notes"
        names = [t["name"] for t in run["tables"]]
        assert len(names) == len(set(names)), run_id
        for table in run["tables"]:
            width = len(table["columns"])
            assert len(table["align"]) == width and set(table["align"]) <= {"l", "r"}
            assert all(len(row) == width for row in table["rows"]), (run_id, table["name"])
            assert all(isinstance(cell, str) for row in table["rows"] for cell in row)


def test_listing_a_run_and_an_unknown_one(capsys):
    assert main([]) == 0
    listed = capsys.readouterr().out
    assert all(f"[{run_id}]" in listed for run_id in load_runs())
    assert main(["2026-11-28-intel-six-families-8", "--table", "families"]) == 0
    shown = capsys.readouterr().out
    assert "| all | 19.5 | 20.8 | 19.8 | 19.5 | **1.05** |" in shown
    assert "Intel Xeon" in shown and "`299f6ed`" in shown
    assert main(["no-such-run"]) == 2
    assert main(["2026-11-28-intel-six-families-8", "--table", "nope"]) == 2


def test_a_block_that_drifts_from_its_records_fails_and_is_rendered_again(tmp_path: Path):
    page = tmp_path / "page.markdown"
    block = "<!-- render_runs: 2026-11-23-model-pairs --table pairs -->\n{}\n"
    block += "<!-- /render_runs -->\n"
    page.write_text("# A page\n\n" + block.format("| hand | copied |\n|---|---|\n| 1 | 2 |"))
    assert check(page, RUNS) != []
    write(page, RUNS)
    assert check(page, RUNS, strict=True) == []
    assert "71.6%" in page.read_text()


def test_a_block_with_arguments_the_script_does_not_take_fails(tmp_path: Path):
    page = tmp_path / "page.markdown"
    page.write_text("<!-- render_runs: --no-such-option -->\n<!-- /render_runs -->\n")
    assert "does not take" in check(page, RUNS)[0]


@pytest.mark.parametrize("line", ["| a | b |", "  | a | b |"])
def test_strict_refuses_a_table_outside_a_block(tmp_path: Path, line: str):
    page = tmp_path / "page.markdown"
    page.write_text(f"# A page\n\n{line}\n|---|---|\n")
    assert check(page, RUNS) == []
    assert check(page, RUNS, strict=True) != []
