#!/usr/bin/env python3
"""Protocol overhead per verify round: a table, not a test.

The overhead of a round is its round trip as the drafter's HTTP client sees it, minus the
verifier's own time for it (`timings.engine_ms`): HTTP, JSON, the hand-off between
threads, and the link. Each row starts a verifier pinned to one core (`taskset`, when
there are two) and runs rounds back to back from the other: plain steps (no draft) and
4-token drafts of the verifier's own tokens. Rows can differ in the verifier's settings
(`--variant name:VAR=value,...`), in the code (`--variant name@DIR`: the verifier of
another checkout, for before/after in one run), and in the added round trip
(`--delays`, through the delaying proxy in scripts/harness).

    .venv/bin/python scripts/bench_overhead.py
    .venv/bin/python scripts/bench_overhead.py --variant "routed:VERIFIER_VERIFY_FAST_PATH=false" \\
        --variant "before@/tmp/before" --delays 0,20
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from drafter.client import VerifierClient
from scripts.harness.cli import HelpFormatter, first_paragraph
from scripts.harness.delay_proxy import DelayProxy
from scripts.harness.local import LocalVerifier
from server.shared.protocol import GenerateRequest, PrefillRequest, VerifyRequest

PROMPT = "The history of the bicycle begins"


def parse_variant(text: str) -> tuple[str, dict[str, str], Path | None]:
    """`name`, `name:VAR=v,VAR=v`, `name@DIR` or `name@DIR:VAR=v`."""
    head, _, settings = text.partition(":")
    name, _, source = head.partition("@")
    env = dict(pair.split("=", 1) for pair in settings.split(",") if pair)
    return name, env, Path(source).resolve() if source else None


def rounds(url: str, n: int, draft: list[int]) -> list[float]:
    """Overhead in ms of `n` rounds of one session, each with the `draft` (re-sent from
    the same committed point: a new session per round would time the prefill)."""
    overheads = []
    with VerifierClient(url, timeout=120) as client:
        for _ in range(n):
            opened = client.prefill(PrefillRequest(prompt=PROMPT))
            request = VerifyRequest(
                session_id=opened.session_id, n_past=opened.total_tokens, draft_tokens=draft
            )
            began = time.perf_counter()
            answer = client.verify(request)
            round_trip_ms = (time.perf_counter() - began) * 1000.0
            overheads.append(round_trip_ms - answer.timings.engine_ms)
            client.delete_session(opened.session_id)
    return overheads


def main() -> None:
    parser = argparse.ArgumentParser(
        description=first_paragraph(__doc__), formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="A verifier to measure (repeat for more): `name`, `name:VAR=value,...` (its "
        "settings, e.g. VERIFIER_VERIFY_FAST_PATH=false), `name@DIR` (the verifier of the "
        "checkout in DIR) or `name@DIR:VAR=value,...`; none given: this checkout's with its "
        "default settings, named 'current'.",
    )
    parser.add_argument(
        "--delays",
        default="0",
        help="Round trips added by the delaying proxy, in ms, comma-separated, e.g. 0,20 "
        "(0: no proxy).",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=200,
        help="Verify rounds per row and pass (rows: plain steps and 4-token drafts, for "
        "each variant and delay).",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="Passes over all rows, alternating between variants so drift falls on all alike.",
    )
    args = parser.parse_args()
    variants = [parse_variant(v) for v in (args.variant or ["current"])]
    delays = [float(d) for d in args.delays.split(",")]
    cores = sorted(os.sched_getaffinity(0))[:2] if hasattr(os, "sched_getaffinity") else []
    pinned = len(cores) == 2 and shutil.which("taskset") is not None
    prefix = ("taskset", "-c", str(cores[1])) if pinned else ()
    env = {"VERIFIER_N_THREADS": "1", "VERIFIER_N_CTX": "1024", "VERIFIER_MAX_SESSIONS": "2"}
    results: dict[tuple[str, float, int], list[float]] = {}
    servers = {}
    try:
        for name, settings, source in variants:
            verifier = LocalVerifier({**env, **settings}, command_prefix=prefix, source=source)
            verifier.wait_ready()
            servers[name] = verifier
        if pinned:
            os.sched_setaffinity(0, {cores[0]})
        with VerifierClient(next(iter(servers.values())).url, timeout=120) as client:
            own = client.generate(GenerateRequest(prompt=PROMPT, max_tokens=4)).tokens
        # Passes alternate between the variants, so that drift in the machine's speed
        # falls on all of them alike.
        for _ in range(args.repeats):
            for delay in delays:
                for name, verifier in servers.items():
                    proxy = DelayProxy(("127.0.0.1", verifier.port), delay) if delay else None
                    if proxy:
                        proxy.start()
                    url = f"http://127.0.0.1:{proxy.port}" if proxy else verifier.url
                    try:
                        for draft in ([], own):
                            key = (name, delay, len(draft))
                            results.setdefault(key, []).extend(rounds(url, args.rounds, draft))
                    finally:
                        if proxy:
                            proxy.close()
    finally:
        for verifier in servers.values():
            verifier.stop()
    where = f"verifier on core {cores[1]}, client on core {cores[0]}" if pinned else "not pinned"
    print(f"{args.rounds * args.repeats} rounds per row, {where}, {os.cpu_count()} cores")
    print("| verifier | added RTT ms | draft tokens | overhead ms, median | p10 | p90 |")
    print("|---|---:|---:|---:|---:|---:|")
    for (name, delay, k), values in results.items():
        values.sort()
        p10, p90 = values[len(values) // 10], values[(9 * len(values)) // 10]
        median = statistics.median(values)
        print(f"| {name} | {delay:g} | {k} | {median:.3f} | {p10:.3f} | {p90:.3f} |")


if __name__ == "__main__":
    main()
