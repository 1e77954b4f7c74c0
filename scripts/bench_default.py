#!/usr/bin/env python3
"""The default against the verifier alone: the CLI as installed (default settings, `auto`
draft length, pipelining on) with `--baseline`, on three chat prompts, each run several
times. A table, not a test.

Verifier and CLI are pinned to one core each (`taskset`), one thread per model, as two
machines as far as two cores can stand for them. Per prompt it prints the median of the
runs' speedups over the verifier alone (`/generate`), the spread, whether every run's
tokens equalled the verifier's, and how the CLI drafted: the mean draft length and the
share of rounds without a draft (k = 0 rounds, where the verifier decodes a chunk of its
own tokens).

    .venv/bin/python scripts/bench_default.py
    .venv/bin/python scripts/bench_default.py --runs 1 --max-tokens 32     # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from scripts.harness.cli import HelpFormatter, first_paragraph  # noqa: E402
from scripts.harness.local import LocalVerifier  # noqa: E402
from server.shared.defaults import DEFAULT_DRAFTER_MODEL, DEFAULT_VERIFIER_MODEL  # noqa: E402

CHAT_PROMPTS = (
    "Explain what a hash table is, in a few sentences.",
    "What should I pack for a weekend of hiking in the mountains?",
    "Write a short, friendly email declining a meeting invitation.",
)


def pinned(core: int | None) -> list[str]:
    if core is None or shutil.which("taskset") is None or (os.cpu_count() or 1) < 2:
        return []
    return ["taskset", "-c", str(core)]


def cli_run(url: str, prompt: str, args: argparse.Namespace) -> dict:
    script = Path(sys.executable).parent / "draft_token_generator"
    command = [*pinned(args.drafter_core), str(script), "--server", url, "--prompt", prompt]
    command += ["--chat", "--baseline", "--output", "json", "--threads", "1"]
    command += ["--model", str(args.drafter_model), "--max-tokens", str(args.max_tokens)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the CLI failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=first_paragraph(__doc__), formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--runs", type=int, default=3, help="Runs per prompt (the median is shown)."
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="Tokens each run generates.")
    parser.add_argument(
        "--verifier-model", type=Path, default=DEFAULT_VERIFIER_MODEL, help="The verifier's GGUF."
    )
    parser.add_argument(
        "--drafter-model", type=Path, default=DEFAULT_DRAFTER_MODEL, help="The drafter's GGUF."
    )
    parser.add_argument(
        "--verifier-core", type=int, default=1, help="Core the verifier is pinned to."
    )
    parser.add_argument("--drafter-core", type=int, default=0, help="Core the CLI is pinned to.")
    args = parser.parse_args()
    env = {"VERIFIER_MODEL_PATH": str(args.verifier_model), "VERIFIER_N_THREADS": "1"}
    rows = []
    with LocalVerifier(env, command_prefix=pinned(args.verifier_core)) as verifier:
        for prompt in CHAT_PROMPTS:
            runs = [cli_run(verifier.url, prompt, args) for _ in range(args.runs)]
            speedups = [run["speedup"] for run in runs]
            stats = [run["stats"] for run in runs]
            rounds = sum(s["rounds"] for s in stats)
            undrafted = sum(s["rounds_by_draft_len"].get("0", 0) for s in stats)
            rows.append(
                (
                    prompt,
                    statistics.median(speedups),
                    min(speedups),
                    max(speedups),
                    all(run["baseline"]["identical"] for run in runs),
                    sum(s["drafted"] for s in stats) / max(rounds, 1),
                    undrafted / max(rounds, 1),
                    statistics.median(run["baseline"]["tokens_per_s"] for run in runs),
                    statistics.median(s["tokens_per_s"] for s in stats),
                )
            )
    print(
        f"verifier {args.verifier_model.name}, drafter {args.drafter_model.name}; one thread "
        f"a side; {args.max_tokens} tokens; {args.runs} runs a prompt; CLI defaults"
    )
    print(
        "| chat prompt | speedup (median) | min-max | identical | mean k | rounds without a "
        "draft | verifier alone tok/s | default CLI tok/s |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for prompt, median, low, high, same, mean_k, undrafted, alone, ours in rows:
        print(
            f"| {prompt} | {median:.2f}x | {low:.2f}-{high:.2f} | {'yes' if same else 'NO'} | "
            f"{mean_k:.2f} | {undrafted:.0%} | {alone:.1f} | {ours:.1f} |"
        )


if __name__ == "__main__":
    main()
