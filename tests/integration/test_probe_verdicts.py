"""A verifier started again on the same build, model and settings takes the startup
probe's verdicts from its folder (VERIFIER_PROBE_CACHE_DIR) instead of probing: it
writes nothing there, and tells what the first start told."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from tests.conftest import start_verifier

pytestmark = pytest.mark.integration

# What /info reports of the probe's verdicts (its timed passes are measured at each start).
VERDICTS = (
    "batch_invariant",
    "pinned_width",
    "pinned_logits",
    "prefill_chunk_invariant",
    "prompt_chunk",
    "prompt_tile_rows",
    "prefix_cache",
)


def written(folder: Path) -> dict[str, int]:
    """Each verdict file and its inode: a probe writes its file anew (a new inode)."""
    return {path.name: path.stat().st_ino for path in folder.glob("*.json")}


def test_a_second_start_on_the_same_inputs_takes_the_probes_verdicts(live_verifier, verifier_model):
    folder = Path(os.environ["VERIFIER_PROBE_CACHE_DIR"])  # the run's (tests/conftest.py)
    first = httpx.get(f"{live_verifier.url}/info", timeout=30).json()
    before = written(folder)
    assert before, "the first start kept its verdicts"
    again = start_verifier(verifier_model)  # live_verifier's settings
    try:
        info = httpx.get(f"{again.url}/info", timeout=30).json()
    finally:
        again.stop()
    assert written(folder) == before  # nothing probed, nothing written
    assert {k: info[k] for k in VERDICTS} == {k: first[k] for k in VERDICTS}
    assert info["pass_cost_rows"] > 0  # its passes timed on this start
