"""Every repository path named in the code, the tests, the scripts and the docs exists.

A comment or a doc that names a file that has moved or gone sends its reader nowhere.
Paths are found as the docs write them: from a top-level folder
(`server/verifier/scheduling/cycle.py`,
`docs/numerics.md`), or a module's bare file name (`gather.py`), which must be some
file's name in the repository. Model files (`*.gguf`) are made by setup, not kept.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = ("server", "drafter", "scripts", "tests", "docs", "deploy", "models", ".ci")
PATH = re.compile(
    r"(?<![\w./-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./*{}-]*[\w*}])"
)
BARE = re.compile(r"(?<![\w./-])([a-z_][a-z0-9_]*\.(?:py|md|sh))\b")


def tracked() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / name for name in out if (ROOT / name).is_file()]


def text_files() -> list[Path]:
    kinds = {".py", ".md", ".sh", ".toml", ".conf", ".txt", ".cfg", ".json"}
    return [
        p
        for p in tracked()
        if (p.suffix in kinds or p.parent.name == ".ci") and p.stat().st_size < 500_000
    ]


def exists(named: str) -> bool:
    named = named.rstrip(".")
    if named.endswith(".gguf"):
        return True
    if "{" in named or "*" in named:
        pattern = re.sub(r"\{[^}]*\}", "*", named)
        return any(ROOT.glob(pattern))
    return (ROOT / named).exists()


def test_every_path_named_exists():
    names = {p.name for p in tracked()}
    missing = []
    for path in text_files():
        if path.name == Path(__file__).name:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{number}"
            missing += [f"{where}: {m}" for m in PATH.findall(line) if not exists(m)]
            missing += [f"{where}: {m}" for m in BARE.findall(line) if m not in names]
    assert not missing, "paths named that do not exist:\n" + "\n".join(missing)
