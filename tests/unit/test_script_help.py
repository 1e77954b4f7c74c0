"""Every script's `--help` is whole: a description not cut mid-sentence, and a sentence of
help for every option."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
COMMANDS = [
    ["bench.py"],
    ["bench_chat.py"],
    ["bench_tasks.py"],
    ["bench_grammar.py"],
    ["bench_grammar_check.py"],
    ["bench_overhead.py"],
    ["bench_pairs.py"],
    ["bystanders.py"],
    ["expect.py"],
    ["failover.py"],
    ["history_probe.py"],
    ["loadtest.py"],
    ["prepare_models.py"],
    ["replicas.py"],
    ["replicas.py", "up"],
    ["replicas.py", "config"],
    ["render_runs.py"],
    ["verify_latency.py"],
]
SECTIONS = ("positional arguments:", "options:")
OPTION = re.compile(r"^ {2}(-\S+)")  # an option's first line; its help may wrap below
HELP_END = re.compile(r"\.( \(default: .*\))?$")


def run_help(command: list[str]) -> str:
    script, *rest = command
    done = subprocess.run(
        [sys.executable, f"scripts/{script}", *rest, "--help"],
        cwd=REPO_ROOT,
        env={**os.environ, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def description(text: str) -> list[str]:
    """The lines between the usage (up to its first blank line) and the first section."""
    body = text.split("\n\n", 1)[1].splitlines()
    end = next(i for i, line in enumerate(body) if line in SECTIONS)
    return [line for line in body[:end] if line.strip()]


def option_helps(text: str) -> dict[str, str]:
    """Each option's help, its wrapped lines joined, by the option's first name."""
    lines = text.split("\noptions:\n", 1)[1].splitlines()
    helps: dict[str, list[str]] = {}
    for line in lines:
        if match := OPTION.match(line):
            name = match.group(1).rstrip(",")
            # The invocation ("--ks KS") ends at two spaces; the help may follow on this line.
            helps[name] = re.split(r" {2,}", line.strip(), maxsplit=1)[1:]
        elif line.strip() and helps:
            helps[name].append(line.strip())
    return {name: " ".join(parts) for name, parts in helps.items()}


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_is_whole(command: list[str]) -> None:
    text = run_help(command)
    described = description(text)
    assert described, "no description"
    assert described[-1].rstrip().endswith((".", ":", ")")), described[-1]
    helps = option_helps(text)
    helps.pop("-h")
    assert helps or command == ["replicas.py"], "no options found"
    for name, help_text in helps.items():
        assert HELP_END.search(help_text), f"{name}: {help_text!r}"
