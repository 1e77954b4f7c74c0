"""`python -m server --help`: every verifier setting, its default and its meaning. The
verifier itself runs under uvicorn: `uvicorn server.main:app --host HOST --port PORT`."""

from __future__ import annotations

import sys
import textwrap

from server.shared.defaults import REPO_ROOT
from server.verifier.settings import VerifierSettings

USAGE = """\
The hetero-specdecode verifier. Run it with uvicorn:

    uvicorn server.main:app --host 127.0.0.1 --port 8000

Its settings are environment variables, read once at start:
"""


def describe() -> str:
    lines = [USAGE]
    for name, field in VerifierSettings.model_fields.items():
        default = field.default
        if hasattr(default, "is_relative_to") and default.is_relative_to(REPO_ROOT):
            default = default.relative_to(REPO_ROOT)
        shown = (
            "(none)"
            if default in (None, "")
            else str(default).lower()
            if isinstance(default, bool)
            else str(default)
        )
        lines.append(f"  VERIFIER_{name.upper()}  [default: {shown}]")
        for line in textwrap.wrap(field.description or "", 76):
            lines.append(f"      {line}")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    sys.stdout.write(describe())
    return 0 if not argv or argv[0] in ("-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
