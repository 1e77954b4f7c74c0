"""`scripts/bench_tasks.py --quick`: the task benchmark runs end to end on the real models
(a verifier of its own for each system, `serve` in front of two of them), measures every
family it is asked for, and `serve`'s greedy answers are the verifier alone's, word for
word, in every family and both turns of a multi-turn question."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from server.shared.defaults import REPO_ROOT

pytestmark = pytest.mark.integration

FAMILIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
LABELS = (
    "multi-turn (MT-Bench)",
    "translation",
    "summarization",
    "question answering",
    "math reasoning",
    "retrieval-augmented",
)
SYSTEMS = ("verifier", "default", "ngram")


def test_quick_task_bench_measures_every_family_and_matches_the_verifier(tmp_path):
    out = tmp_path / "tasks.json"
    completed = subprocess.run(
        [sys.executable, "scripts/bench_tasks.py", "--quick", "--json", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads(out.read_text())
    summary, answers = results["summary"], results["answers"]

    # Every family asked for, and "all", each with every system's figures.
    assert list(summary) == [*FAMILIES, "all"]
    for family, block in summary.items():
        assert set(block) == set(SYSTEMS), family
        for system, figures in block.items():
            assert figures["tokens"] > 0, (family, system)
            assert math.isfinite(figures["tokens_per_s"]) and figures["tokens_per_s"] > 0
            mean_accepted = figures["mean_accepted_tokens"]
            assert math.isfinite(mean_accepted) and mean_accepted >= 1.0, (family, system)
    assert summary["all"]["verifier"]["mean_accepted_tokens"] == 1.0  # it never drafts
    for system in SYSTEMS:
        whole = summary["all"][system]
        assert whole["tokens"] == sum(summary[f][system]["tokens"] for f in FAMILIES)
        # One question a family; the multi-turn one is asked in two turns.
        assert whole["answers"] == len(FAMILIES) + 1

    # The answers: 16 tokens at most, the second turn after the first, and each of
    # `serve`'s greedy answers is the verifier alone's for the same question and turn.
    by_key = {(a["system"], a["question_id"], a["turn"]): a for a in answers}
    assert len(by_key) == len(answers) == len(SYSTEMS) * (len(FAMILIES) + 1)
    turns = {(a["family"], a["turn"]) for a in answers}
    assert ("mt_bench", 2) in turns and ("rag", 2) not in turns
    for a in answers:
        assert 0 < a["tokens"] <= 16 and a["seconds"] > 0, a
        assert a["text"].strip(), a
        if a["system"] != "verifier":
            reference = by_key[("verifier", a["question_id"], a["turn"])]
            assert a["text"] == reference["text"], (a, reference)
            assert a["tokens"] == reference["tokens"], (a, reference)
            assert a["accepted"] is not None and 0 <= a["accepted"] <= a["tokens"]
            # By kind, as the verifier counted them: what `serve` said it had accepted is
            # the draft model's and the lookups' together, and the copies the rest.
            kinds = a["extra"]["by_kind"]
            assert all(0 <= got <= drafted for drafted, got in kinds.values()), kinds
            assert a["accepted"] == sum(got for _, got in kinds.values()), (a, kinds)
            if a["system"] == "ngram":  # prompt lookup alone: every draft a lookup's
                assert kinds["model"] == [0, 0], kinds
    for system in ("default", "ngram"):
        assert summary["all"][system]["identical"] == summary["all"][system]["compared"] == 7

    # The printed tables: a row per family and "all", with a ratio to the verifier alone.
    table = completed.stdout
    for label in LABELS:
        assert f"| {label} | 1 |" in table, label
    assert "| **all** | **6** |" in table
    assert "default / verifier alone" in table
    assert "Greedy answers equal to the verifier alone's: ours, default 7/7, ours, ngram 7/7." in (
        table
    )
