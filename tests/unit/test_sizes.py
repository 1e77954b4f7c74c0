"""Files and classes stay small enough to hold in one's head: no module of the verifier or
the drafter over 400 lines, no class over 250."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 400
MAX_CLASS_LINES = 250


def modules() -> list[Path]:
    return sorted(p for top in ("server", "drafter") for p in (ROOT / top).rglob("*.py"))


def test_no_module_is_too_long():
    long = {
        str(p.relative_to(ROOT)): n
        for p in modules()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"over {MAX_FILE_LINES} lines: {long}"


def test_no_class_is_too_long():
    long = {}
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = size
    assert not long, f"classes over {MAX_CLASS_LINES} lines: {long}"
