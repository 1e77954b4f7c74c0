#!/usr/bin/env python3
"""Whether a folder of wheels is closed under its requirements for a target Python (3.12,
Linux, x86-64), but for packages named present there: what it lacks is named and the
exit status is 1. For the GPU kit (scripts/gpu/prepare_kit.sh), whose wheels are
installed with --no-deps on a machine with no network.

    .venv/bin/python scripts/gpu/check_wheels.py gpu-kit/wheels --present numpy
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

TARGET = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}


def metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(archive.read(name).decode())


def missing(wheels: list[Path], present: set[str]) -> list[str]:
    found = {canonicalize_name(metadata(w)["Name"]): w for w in wheels}
    have = set(found) | present
    lacking = []
    for name, wheel in sorted(found.items()):
        for line in metadata(wheel).get_all("Requires-Dist") or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate(TARGET):
                continue
            if canonicalize_name(requirement.name) not in have:
                lacking.append(f"{name} needs {requirement}")
    return lacking


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--present", default="", help="comma-separated, there already")
    args = parser.parse_args()
    present = {canonicalize_name(n) for n in args.present.split(",") if n}
    lacking = missing(sorted(args.folder.glob("*.whl")), present)
    for line in lacking:
        print(f"[check_wheels] missing: {line}")
    return 1 if lacking else 0


if __name__ == "__main__":
    sys.exit(main())
