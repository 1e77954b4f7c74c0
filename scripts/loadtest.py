#!/usr/bin/env python3
"""Load test: N concurrent drafters (the real drafter loop) against one verifier.

For each N it prints aggregate verified tokens/s, p50/p99 round latency, errors, mean
sessions per decode batch, and the server's efficiency: the time llama_decode itself took
on the batches the server ran, divided by the server's busy wall time (at least one
request in flight), both read from the server's /metrics in the same run. A table, not a
test. Without --server it starts its own verifier on 127.0.0.1.

    python scripts/loadtest.py --drafters 1,2,4,8 --rounds 30
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import threading
import time
from pathlib import Path

import httpx

from drafter.client import VerifierClient
from drafter.loop import SpeculativeLoop
from drafter.model import DraftModel
from server import DEFAULT_DRAFTER_MODEL
from server.local import LocalVerifier
from server.protocol import PrefillRequest, VerifyRequest, VerifyResponse

REPO_ROOT = Path(__file__).resolve().parent.parent

PROMPTS = [
    "The history of the bicycle begins",
    "def merge_sort(items):\n",
    "Shopping list:\n1.",
    "Dear Sir or Madam,",
    "SELECT name, email FROM",
    "The recipe for bread needs",
    "In 1969, the first humans",
    "Once upon a time, in a village",
]


class TimedClient(VerifierClient):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.round_s: list[float] = []

    def verify(self, request: VerifyRequest) -> VerifyResponse:
        began = time.perf_counter()
        response = super().verify(request)
        self.round_s.append(time.perf_counter() - began)
        return response


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    wanted = (
        "verifier_decode_seconds_sum",
        "verifier_busy_seconds_total",
        "verifier_batch_sessions_sum",
        "verifier_batch_sessions_count",
    )
    values = {}
    for name in wanted:
        match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
        values[name] = float(match.group(1)) if match else 0.0
    return values


def run_level(url: str, n: int, rounds: int, draft_n: int, threads: int, n_ctx: int) -> dict:
    models = [
        DraftModel(DEFAULT_DRAFTER_MODEL, n_ctx=n_ctx + 256, n_threads=threads) for _ in range(n)
    ]
    clients = [TimedClient(url, timeout=300) for _ in range(n)]
    tokens = [0] * n
    errors: list[str] = []
    barrier = threading.Barrier(n + 1)

    def drafter(i: int) -> None:
        loop = SpeculativeLoop(models[i], clients[i], draft_n=draft_n, n_ctx=n_ctx)
        barrier.wait()
        try:
            run = loop.run(PrefillRequest(prompt=PROMPTS[i % len(PROMPTS)]), rounds * (draft_n + 1))
            for done, event in enumerate(run, start=1):
                tokens[i] += len(event.tokens)
                if done == rounds or event.eos:
                    run.close()
                    break
        except Exception as exc:  # counted, reported: a load test keeps going
            errors.append(f"{type(exc).__name__}: {exc}")

    workers = [threading.Thread(target=drafter, args=(i,)) for i in range(n)]
    for worker in workers:
        worker.start()
    before = scrape(url)
    barrier.wait()
    began = time.perf_counter()
    for worker in workers:
        worker.join()
    wall = time.perf_counter() - began
    after = scrape(url)
    for model in models:
        model.close()
    for client in clients:
        client.close()
    delta = {k: after[k] - before[k] for k in after}
    latencies = sorted(s for c in clients for s in c.round_s)
    batches = delta["verifier_batch_sessions_count"]
    return {
        "drafters": n,
        "tokens_per_s": sum(tokens) / wall,
        "p50_ms": statistics.median(latencies) * 1000 if latencies else 0.0,
        "p99_ms": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1000
        if latencies
        else 0.0,
        "errors": len(errors),
        "sessions_per_batch": delta["verifier_batch_sessions_sum"] / batches if batches else 0,
        "efficiency": delta["verifier_decode_seconds_sum"] / delta["verifier_busy_seconds_total"]
        if delta["verifier_busy_seconds_total"]
        else 0.0,
        "first_error": errors[0] if errors else "",
    }


def spawn_verifier(max_sessions: int, threads: int) -> LocalVerifier:
    env = {
        "VERIFIER_MAX_SESSIONS": str(max_sessions),
        "VERIFIER_N_THREADS": str(threads),
        "VERIFIER_N_CTX": "1024",
    }
    verifier = LocalVerifier(env)
    verifier.wait_ready()
    return verifier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", help="verifier URL (default: start one on 127.0.0.1)")
    parser.add_argument("--drafters", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=30, help="rounds per drafter")
    parser.add_argument("--draft-n", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per model")
    args = parser.parse_args()
    levels = [int(x) for x in args.drafters.split(",")]
    verifier = None
    url = args.server
    if url is None:
        verifier = spawn_verifier(max(levels), args.threads)
        url = verifier.url
    try:
        n_ctx = httpx.get(f"{url}/info").json()["n_ctx"]
        print(
            f"verifier {url}; {args.rounds} rounds per drafter, k = {args.draft_n}, "
            f"{args.threads} thread(s) per model, {os.cpu_count()} cores"
        )
        print(
            "| drafters | aggregate tokens/s | p50 round ms | p99 round ms | errors "
            "| sessions/batch | efficiency |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for n in levels:
            row = run_level(url, n, args.rounds, args.draft_n, args.threads, n_ctx)
            print(
                f"| {n} | {row['tokens_per_s']:.1f} | {row['p50_ms']:.1f} | "
                f"{row['p99_ms']:.1f} | {row['errors']} | {row['sessions_per_batch']:.2f} | "
                f"{row['efficiency']:.2f} |",
                flush=True,
            )
            if row["first_error"]:
                print(f"    first error: {row['first_error']}")
    finally:
        if verifier is not None:
            verifier.stop()


if __name__ == "__main__":
    main()
