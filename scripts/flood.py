#!/usr/bin/env python3
"""Flood: one key's rounds beside another key's flood of prompt texts as large as the body
limit takes. A table, not a test.

Key A runs one replayed drafter, alone and then while key B posts 4 MB prompt texts to
/prefill on two connections, as fast as they are answered. It prints A's round latency
both times, what B's posts were answered, and the verifier's resident memory (RSS)
before and during the flood.

    .venv/bin/python scripts/flood.py
    .venv/bin/python scripts/flood.py --rounds 300 --text-mb 4
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from scripts.harness.cli import HelpFormatter, first_paragraph
from scripts.harness.load import PROMPTS, run_drafters
from scripts.harness.local import LocalVerifier

KEYS = ("alice-flood-key", "mallory-flood-key")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=first_paragraph(__doc__), formatter_class=HelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=300, help="Key A's verify rounds a run.")
    parser.add_argument(
        "--text-mb", type=float, default=4.0, help="Size of each of key B's prompt texts, in MB."
    )
    parser.add_argument("--connections", type=int, default=2, help="Key B's connections.")
    parser.add_argument(
        "--compare-with",
        metavar="DIR",
        help="Another checkout of this repository whose verifier to flood instead; None: "
        "this checkout's.",
    )
    args = parser.parse_args()
    env = {"VERIFIER_API_KEYS": ",".join(KEYS), "VERIFIER_ADMIN_API_KEYS": KEYS[0]}
    text = "x" * int(args.text_mb * 1_000_000)
    source = Path(args.compare_with).resolve() if args.compare_with else None
    with LocalVerifier(env, source=source) as verifier:
        pid = verifier.process.pid
        common = {
            "rounds": args.rounds,
            "draft_n": 4,
            "api_keys": [KEYS[0]],
            "metrics_key": KEYS[0],
        }
        alone = run_drafters(verifier.url, [verifier.url], PROMPTS[:1], **common)
        rss_before = rss_mb(pid)
        statuses: Counter[str] = Counter()
        rss_during: list[float] = []
        stop = threading.Event()

        def post_texts() -> None:
            with httpx.Client(timeout=600, headers={"Authorization": f"Bearer {KEYS[1]}"}) as b:
                while not stop.is_set():
                    reply = b.post(f"{verifier.url}/prefill", json={"prompt": text})
                    statuses[
                        f"{reply.status_code} {reply.json()['error']['type']}"
                        if reply.status_code >= 400
                        else str(reply.status_code)
                    ] += 1
                    rss_during.append(rss_mb(pid))

        flooders = [threading.Thread(target=post_texts) for _ in range(args.connections)]
        for flooder in flooders:
            flooder.start()
        time.sleep(1.0)  # the flood under way
        try:
            during = run_drafters(verifier.url, [verifier.url], PROMPTS[:1], **common)
        finally:
            stop.set()
            for flooder in flooders:
                flooder.join()
    print(
        f"verifier: {args.compare_with or 'this checkout'}; key A: one replayed drafter, "
        f"{args.rounds} rounds, k = 4; key B: {args.connections} connections posting "
        f"{args.text_mb:g} MB prompt texts"
    )
    print("| key A's rounds | p50 ms | p99 ms | max ms | verifier RSS MB |")
    print("|---|---:|---:|---:|---:|")
    print(
        f"| alone | {alone.p50_ms:.1f} | {alone.latency_ms(0.99):.1f} | "
        f"{alone.latency_ms(1.0):.1f} | {rss_before:.0f} |"
    )
    print(
        f"| beside the flood | {during.p50_ms:.1f} | {during.latency_ms(0.99):.1f} | "
        f"{during.latency_ms(1.0):.1f} | {max(rss_during, default=float('nan')):.0f} (max) |"
    )
    print(
        f"key B's posts: {dict(statuses)}; key A's errors: {len(during.errors)}, "
        f"output as /generate: {'yes' if not during.mismatches else 'NO'}"
    )


if __name__ == "__main__":
    main()
