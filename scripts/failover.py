#!/usr/bin/env python3
"""Failover timeline: drafters through nginx to three verifier replicas, one replica
killed (SIGKILL) mid-generation. For each session it prints how long its generation stood
still (from the kill to its next committed round) beside its usual round time, its
recoveries, and whether its output equals the verifier decoding alone. A table, not a test.

    .venv/bin/python scripts/failover.py --drafters 8 --tokens 64
"""

from __future__ import annotations

import argparse
import itertools
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from drafter.client import VerifierClient
from drafter.drafters.model import DraftModel
from drafter.speculative.loop import SpeculativeLoop
from scripts.harness.cli import HelpFormatter, first_paragraph
from scripts.harness.load import PROMPTS
from scripts.harness.metrics import Metrics
from scripts.harness.replicas import LocalReplicas
from server.shared.defaults import DEFAULT_DRAFTER_MODEL
from server.shared.protocol import PrefillRequest
from server.verifier.settings import VerifierSettings

ROUNDS_BEFORE_KILL = 3
N_CTX = 1024


def active_sessions(url: str) -> float:
    return Metrics.scrape(url).value("verifier_active_sessions")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=first_paragraph(__doc__), formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--drafters",
        type=int,
        default=8,
        help="Concurrent drafters (one session each) spread over the three replicas.",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=64,
        help="Tokens per generation (enough that no drafter ends before the kill).",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads per model: each verifier replica's and the draft model's.",
    )
    args = parser.parse_args()
    n = args.drafters
    env = {
        "VERIFIER_N_THREADS": str(args.threads),
        "VERIFIER_N_CTX": str(N_CTX),
        "VERIFIER_MAX_SESSIONS": str(n),
    }
    owner = DraftModel(DEFAULT_DRAFTER_MODEL, n_ctx=N_CTX + 256, n_seq=n, n_threads=args.threads)
    models = [owner] + [DraftModel.on(owner.context, i) for i in range(1, n)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    round_times: list[list[float]] = [[] for _ in range(n)]
    results: list = [None] * n
    with LocalReplicas(3, env, VerifierSettings().max_body_bytes) as replicas:
        solo = [
            httpx.post(
                f"{replicas.url}/generate",
                json={"prompt": p, "max_tokens": args.tokens},
                timeout=600,
            ).json()["tokens"]
            for p in prompts
        ]

        def drafter(i: int) -> None:
            with VerifierClient(replicas.url, timeout=120) as client:
                loop = SpeculativeLoop(models[i], client, draft_n=4, n_ctx=N_CTX)
                for _ in loop.run(PrefillRequest(prompt=prompts[i]), args.tokens):
                    round_times[i].append(time.perf_counter())
                results[i] = loop.result

        threads = [threading.Thread(target=drafter, args=(i,)) for i in range(n)]
        for thread in threads:
            thread.start()
        while min(len(t) for t in round_times) < ROUNDS_BEFORE_KILL:
            if not all(thread.is_alive() for thread in threads):
                raise SystemExit("a drafter ended before the kill: use more --tokens")
            time.sleep(0.01)
        loads = [active_sessions(v.url) for v in replicas.verifiers]
        victim = replicas.verifiers[loads.index(max(loads))]
        killed_at = time.perf_counter()
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait()
        for thread in threads:
            thread.join()

    print(
        f"3 replicas behind nginx, {n} drafters, {args.tokens} tokens each; "
        f"killed the replica holding {int(max(loads))} of the sessions "
        f"(sessions per replica: {'/'.join(str(int(x)) for x in loads)})"
    )
    print("| drafter | recoveries | usual round ms | stood still ms | output as alone |")
    print("|---:|---:|---:|---:|---|")
    for i in range(n):
        times = round_times[i]
        before = [b - a for a, b in itertools.pairwise(times) if b < killed_at]
        after = [t for t in times if t > killed_at]
        previous = max((t for t in times if t <= killed_at), default=killed_at)
        usual = statistics.median(before) * 1000 if before else float("nan")
        still = (after[0] - killed_at) * 1000 if after else float("nan")
        result = results[i]
        print(
            f"| {i} | {result.stats.recoveries} | {usual:.0f} | {still:.0f} "
            f"(last round {(killed_at - previous) * 1000:.0f} ms before the kill) "
            f"| {result.tokens == solo[i]} |"
        )
    owner.close()


if __name__ == "__main__":
    main()
