"""The measured runs as data, rendered as markdown.

Every run behind docs/performance.md is one JSON record in docs/runs/ (its date, machine,
commit, the commands that made it, its tables and notes; docs/runs/machines.json names the
machines). This script renders them: with no arguments it lists the runs; with a run's id
it prints that run whole, or one table of it (--table); with runs' ids and --commands,
their commands as one shell block.

A page holds rendered output between `<!-- render_runs: ARGS -->` and
`<!-- /render_runs -->`, where ARGS are this script's arguments. --check verifies that each
such block is what this script renders from the records now, and with --strict that the
page has no table outside such blocks; --write renders the blocks again in place.

Examples:
  .venv/bin/python scripts/render_runs.py
  .venv/bin/python scripts/render_runs.py 2026-11-28-intel-six-families-8
  .venv/bin/python scripts/render_runs.py --check docs/performance.md --strict"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "runs"
BLOCK = re.compile(r"<!-- render_runs:(.*?)-->\n(.*?)<!-- /render_runs -->", re.S)
ALIGN = {"l": "---", "r": "---:"}


class RunError(Exception):
    """A run, a table or a block that does not exist or does not match."""


def load_runs(runs_dir: Path = RUNS) -> dict[str, dict]:
    """Every run record, by id, oldest first."""
    runs = [json.loads(p.read_text()) for p in sorted(runs_dir.glob("*.json"))]
    runs = [r for r in runs if "id" in r]  # machines.json is not a run
    return {r["id"]: r for r in sorted(runs, key=lambda r: (r["date"], r["id"]))}


def load_machines(runs_dir: Path = RUNS) -> dict[str, dict]:
    return json.loads((runs_dir / "machines.json").read_text())


def commits(run: dict, table: dict | None = None) -> str:
    named = (table or {}).get("commit") or run["commit"]
    named = [named] if isinstance(named, str) else named
    shown = ", ".join(f"`{c}`" for c in named)
    return f"measured at {shown}" if run["commit_kind"] == "measured" else f"published with {shown}"


def source(run: dict, machines: dict, table: dict | None = None) -> str:
    machine = machines[run["machine"]]["name"]
    return (
        f"run [{run['id']}](runs/{run['id']}.json): {run['date']}, {machine}, "
        f"{commits(run, table)}, `{run['script']}`"
    )


def markdown_table(table: dict) -> list[str]:
    columns, align = table["columns"], table["align"]
    if len(align) != len(columns) or any(len(row) != len(columns) for row in table["rows"]):
        raise RunError(f"table {table['name']}: rows, columns and alignment differ in width")
    lines = [row_line(columns), "|" + "|".join(ALIGN[a] for a in align) + "|"]
    return lines + [row_line(row) for row in table["rows"]]


def row_line(cells: list[str]) -> str:
    return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"


def find_table(run: dict, name: str) -> dict:
    for table in run["tables"]:
        if table["name"] == name:
            return table
    names = ", ".join(t["name"] for t in run["tables"]) or "none"
    raise RunError(f"run {run['id']} has no table {name!r} (its tables: {names})")


def render_table(run: dict, name: str, machines: dict) -> str:
    table = find_table(run, name)
    kind = "Computed, not measured, from" if table.get("computed") else "From"
    caption = f"*{table['title']}.* {kind} {source(run, machines, table)}."
    return "\n".join([caption, "", *markdown_table(table)])


def render_commands(runs: list[dict], machines: dict) -> str:
    """One shell block; with several runs, each run's commands under a comment naming it."""
    lines = ["```bash"]
    for run in runs:
        if len(runs) > 1:
            lines.append(f"# {run['id']} ({machines[run['machine']]['name']})")
        lines += run["commands"]
    return "\n".join([*lines, "```"])


def render_run(run: dict, machines: dict) -> str:
    machine = machines[run["machine"]]
    out = [
        f"# {run['title']}",
        "",
        f"- run: `{run['id']}`",
        f"- date: {run['date']}",
        f"- machine: {machine['name']}: {machine['description']}",
        f"- models: {run['models']}",
        f"- code: {commits(run)}",
        f"- script: `{run['script']}`",
        "",
        run["setup"],
        "",
        render_commands([run], machines),
    ]
    for table in run["tables"]:
        out += ["", render_table(run, table["name"], machines)]
    out += [line for note in run.get("notes", []) for line in ("", note)]
    if run.get("files"):
        out += ["", "Files: " + ", ".join(f"`{f}`" for f in run["files"]) + "."]
    return "\n".join(out)


def render_index(runs: dict[str, dict], machines: dict) -> str:
    lines = ["| run | date | machine | script | tables | what |", "|---|---|---|---|---:|---|"]
    for run in runs.values():
        link = f"[{run['id']}](runs/{run['id']}.json)"
        machine = machines[run["machine"]]["name"]
        lines.append(
            f"| {link} | {run['date']} | {machine} | `{run['script']}` | "
            f"{len(run['tables'])} | {run['title']} |"
        )
    return "\n".join(lines)


def render(args: argparse.Namespace, runs_dir: Path) -> str:
    runs, machines = load_runs(runs_dir), load_machines(runs_dir)
    if not args.runs:
        if args.table or args.commands:
            raise RunError("--table and --commands need a run id")
        return render_index(runs, machines)
    unknown = [r for r in args.runs if r not in runs]
    if unknown:
        raise RunError(f"no run {unknown[0]!r} in {runs_dir} (with no arguments: the list)")
    chosen = [runs[r] for r in args.runs]
    if args.table:
        if len(chosen) > 1:
            raise RunError("--table takes one run id")
        return render_table(chosen[0], args.table, machines)
    if args.commands:
        return render_commands(chosen, machines)
    return "\n\n".join(render_run(run, machines) for run in chosen)


def block_output(arguments: str, runs_dir: Path) -> str:
    try:
        args = parser().parse_args(shlex.split(arguments))
    except SystemExit as exited:  # argparse has printed why
        raise RunError(f"arguments this script does not take: {arguments.strip()!r}") from exited
    return render(args, runs_dir)


def check(path: Path, runs_dir: Path = RUNS, strict: bool = False) -> list[str]:
    """What differs between the page's rendered blocks and the records (empty: nothing)."""
    text = path.read_text()
    problems = []
    for match in BLOCK.finditer(text):
        try:
            expected = block_output(match[1], runs_dir)
        except RunError as error:
            problems.append(f"{path}: block '{match[1].strip()}': {error}")
            continue
        if match[2].strip("\n") != expected:
            problems.append(f"{path}: block '{match[1].strip()}' differs from its records")
    if strict:
        outside = BLOCK.sub("", text)
        for line in outside.splitlines():
            if line.lstrip().startswith("|"):
                problems.append(f"{path}: a table outside a rendered block: {line.strip()[:60]}")
                break
    return problems


def write(path: Path, runs_dir: Path = RUNS) -> None:
    """The page's rendered blocks rendered again from the records."""

    def again(match: re.Match) -> str:
        rendered = block_output(match[1], runs_dir)
        return f"<!-- render_runs:{match[1]}-->\n{rendered}\n<!-- /render_runs -->"

    path.write_text(BLOCK.sub(again, path.read_text()))


def parser() -> argparse.ArgumentParser:
    out = argparse.ArgumentParser(
        description=__doc__.split("Examples:")[0].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    out.add_argument(
        "runs", nargs="*", metavar="RUN", help="runs' ids: print those runs (none: list every run)."
    )
    out.add_argument("--table", help="print only this table of the run, with its source line.")
    out.add_argument(
        "--commands", action="store_true", help="print only the runs' commands, as one shell block."
    )
    out.add_argument(
        "--runs-dir",
        type=Path,
        default=RUNS,
        help="the folder of run records (default: docs/runs).",
    )
    out.add_argument(
        "--check",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="verify that each rendered block of these pages is what the records render.",
    )
    out.add_argument(
        "--strict", action="store_true", help="with --check, a table outside a block fails too."
    )
    out.add_argument(
        "--write", type=Path, nargs="+", metavar="FILE", help="render these pages' blocks again."
    )
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.check:
            problems = [p for f in args.check for p in check(f, args.runs_dir, args.strict)]
            print(
                "\n".join(problems)
                or f"rendered blocks match the records: {len(args.check)} file(s)"
            )
            return 1 if problems else 0
        if args.write:
            for path in args.write:
                write(path, args.runs_dir)
            return 0
        print(render(args, args.runs_dir))
    except RunError as error:
        print(f"render_runs: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
