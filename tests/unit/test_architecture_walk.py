"""docs/architecture.md walks a round and a prompt through the files: every file it names
exists, and every function or class it names is defined in a file named at that point of
the walk or before it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
IDENTIFIER = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)?")


def defined(path: Path) -> set[str]:
    """Classes, functions, methods (as `Class.method` and bare) and module-level names."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names |= {item.name, f"{node.name}.{item.name}"}
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def walk_items() -> list[str]:
    """The numbered steps of the walk's sections, each as one string."""
    text = DOC.read_text()
    walk = text[text.index("## A round's path through the files") :]
    return [m[0] for m in re.finditer(r"^\d+\. .*?(?=^\d+\. |^#|^On |^And |\Z)", walk, re.M | re.S)]


def test_the_walk_names_only_files_and_functions_that_exist():
    items = walk_items()
    assert len(items) >= 10
    known: set[str] = set()
    problems = []
    for item in items:
        for token in re.findall(r"`([^`]+)`", item):
            if token.endswith(".py"):
                path = ROOT / token
                if not path.is_file():
                    problems.append(f"no file {token}")
                    continue
                known |= defined(path)
            elif IDENTIFIER.fullmatch(token) and token not in known:
                problems.append(f"{token!r} is not defined in a file named before it")
    assert not problems, "\n".join(problems)
