#!/usr/bin/env python3
"""Restart drill: the verifier killed (SIGKILL) in the middle of a generation and started
again with the same command, under the CLI and `serve` (streamed and whole completions)
made with their default settings. A table, not a test.

For each client it prints whether the generation finished, whether its output equals the
verifier's own decoding of the prompt, how many sessions it opened again, how long the
verifier took to come back (kill to /health 200), and how long after the kill the client
had its last token.

    .venv/bin/python scripts/restart_drill.py
    .venv/bin/python scripts/restart_drill.py --max-tokens 300 --threads 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.harness.cli import HelpFormatter, first_paragraph
from scripts.harness.restart import run_drills
from server.shared.defaults import DEFAULT_DRAFTER_MODEL, DEFAULT_VERIFIER_MODEL


def main() -> None:
    parser = argparse.ArgumentParser(
        description=first_paragraph(__doc__), formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--verifier-model", default=str(DEFAULT_VERIFIER_MODEL), help="The verifier's GGUF."
    )
    parser.add_argument(
        "--drafter-model", default=str(DEFAULT_DRAFTER_MODEL), help="The drafter's GGUF."
    )
    parser.add_argument(
        "--prompt", default="The rules of chess say that", help="The prompt of every drill."
    )
    parser.add_argument("--max-tokens", type=int, default=200, help="Tokens each drill generates.")
    parser.add_argument("--threads", type=int, default=1, help="Threads of each side.")
    args = parser.parse_args()
    env = {
        "VERIFIER_MODEL_PATH": args.verifier_model,
        "VERIFIER_N_THREADS": str(args.threads),
    }
    rows = run_drills(
        env, Path(args.drafter_model), args.prompt, args.max_tokens, threads=args.threads
    )
    print(
        f"verifier {Path(args.verifier_model).name}, drafter {Path(args.drafter_model).name}; "
        f"{args.max_tokens} tokens; SIGKILL after two answered rounds, then the same command"
    )
    print("| client | finished | identical | sessions reopened | restart s | done after kill s |")
    print("|---|---|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row.client} | {'yes' if row.finished else 'NO'} | "
            f"{'yes' if row.identical else 'NO'} | {row.recoveries} | {row.restart_s:.1f} | "
            f"{row.finished_after_s:.1f} |"
        )
        if row.error:
            print(f"  {row.client}: {row.error}")


if __name__ == "__main__":
    main()
