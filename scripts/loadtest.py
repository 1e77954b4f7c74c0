#!/usr/bin/env python3
"""Load test: concurrent drafters (the real drafter loop) against verifier replicas.

For each setup it prints aggregate verified tokens/s, p50/p99 round latency, errors,
sessions per decode batch, how the sessions spread over the replicas, and the replicas'
efficiency: the time llama_decode itself took divided by the replicas' busy wall time (at
least one request in flight), both read from their /metrics in the same run. A table, not
a test.

    python scripts/loadtest.py --replicas 1,2,3 --drafters 8     # own verifiers + nginx
    python scripts/loadtest.py --drafters 1,2,4,8                # one own verifier
    python scripts/loadtest.py --servers http://balancer:8000 --drafters 8 \\
        --metrics http://10.0.0.11:8000,http://10.0.0.12:8000      # a deployment

With --replicas, every replica runs on this machine and they share its cores: the second
table gives what the same spread of sessions would reach with each replica on its own
machine, from single-replica runs with as many drafters as each replica got.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from drafter.client import VerifierClient
from drafter.loop import SpeculativeLoop
from drafter.model import DraftModel
from server import DEFAULT_DRAFTER_MODEL
from server.local import LocalVerifier
from server.protocol import PrefillRequest, VerifyRequest, VerifyResponse
from server.replicas import LocalReplicas
from server.settings import VerifierSettings

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
METRICS = (
    "verifier_decode_seconds_sum",
    "verifier_busy_seconds_total",
    "verifier_batch_sessions_sum",
    "verifier_batch_sessions_count",
    'verifier_requests_total{endpoint="/prefill",status="200"}',
)


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
    values = {}
    for name in METRICS:
        match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
        values[name] = float(match.group(1)) if match else 0.0
    return values


def run_level(
    url: str, metrics_urls: list[str], n: int, rounds: int, draft_n: int, threads: int, n_ctx: int
) -> dict:
    # One draft context, a sequence per drafter (as `serve --parallel n` has).
    owner = DraftModel(DEFAULT_DRAFTER_MODEL, n_ctx=n_ctx + 256, n_seq=n, n_threads=threads)
    models = [owner] + [DraftModel.on(owner.context, i) for i in range(1, n)]
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
    before = [scrape(u) for u in metrics_urls]
    barrier.wait()
    began = time.perf_counter()
    for worker in workers:
        worker.join()
    wall = time.perf_counter() - began
    after = [scrape(u) for u in metrics_urls]
    owner.close()
    for client in clients:
        client.close()
    deltas = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    total = {k: sum(d[k] for d in deltas) for k in METRICS}
    latencies = sorted(s for c in clients for s in c.round_s)
    batches = total["verifier_batch_sessions_count"]
    busy = total["verifier_busy_seconds_total"]
    return {
        "drafters": n,
        "tokens_per_s": sum(tokens) / wall,
        "p50_ms": statistics.median(latencies) * 1000 if latencies else 0.0,
        "p99_ms": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1000
        if latencies
        else 0.0,
        "errors": len(errors),
        "sessions_per_batch": total["verifier_batch_sessions_sum"] / batches if batches else 0,
        "efficiency": total["verifier_decode_seconds_sum"] / busy if busy else 0.0,
        "spread": [
            int(d['verifier_requests_total{endpoint="/prefill",status="200"}']) for d in deltas
        ],
        "first_error": errors[0] if errors else "",
    }


def print_header(first: str) -> None:
    print(
        f"| {first} | drafters | aggregate tokens/s | p50 round ms | p99 round ms | errors "
        "| sessions/batch | efficiency | sessions per replica |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")


def print_row(first: object, row: dict) -> None:
    spread = "/".join(str(s) for s in row["spread"])
    print(
        f"| {first} | {row['drafters']} | {row['tokens_per_s']:.1f} | {row['p50_ms']:.1f} | "
        f"{row['p99_ms']:.1f} | {row['errors']} | {row['sessions_per_batch']:.2f} | "
        f"{row['efficiency']:.2f} | {spread} |",
        flush=True,
    )
    if row["first_error"]:
        print(f"    first error: {row['first_error']}")


def verifier_env(threads: int, sessions: int) -> dict[str, str]:
    return {
        "VERIFIER_MAX_SESSIONS": str(sessions),
        "VERIFIER_N_THREADS": str(threads),
        "VERIFIER_N_CTX": "1024",
    }


def replica_runs(args: argparse.Namespace, levels: list[int]) -> None:
    counts = [int(x) for x in args.replicas.split(",")]
    max_body = VerifierSettings().max_body_bytes
    print(
        f"{args.rounds} rounds per drafter, k = {args.draft_n}, {args.threads} thread(s) per "
        f"model, every process on this machine ({os.cpu_count()} cores), nginx in front"
    )
    print_header("replicas")
    spreads: dict[int, list[int]] = {}
    measured: dict[int, float] = {}
    for count in counts:
        with LocalReplicas(count, verifier_env(args.threads, max(levels)), max_body) as replicas:
            urls = [v.url for v in replicas.verifiers]
            for n in levels:
                row = run_level(
                    replicas.url, urls, n, args.rounds, args.draft_n, args.threads, 1024
                )
                print_row(count, row)
                spreads[count], measured[count] = row["spread"], row["tokens_per_s"]
    if not args.model:
        return
    # One replica per machine: replica j with s_j sessions does what one replica alone
    # does with s_j drafters. Measured here with that replica alone on one core and the
    # drafters on another, as a verifier machine and the users' machines would be.
    alone: dict[int, float] = {}
    own_cores = os.sched_getaffinity(0)
    # The first two cores this process may use (a container may allow others than 0, 1).
    cores = sorted(own_cores)[:2]
    pinned = len(cores) == 2 and shutil.which("taskset") is not None
    for sessions in sorted({s for spread in spreads.values() for s in spread if s}):
        prefix = ("taskset", "-c", str(cores[1])) if pinned else ()
        with LocalReplicas(1, verifier_env(args.threads, max(levels)), max_body, prefix) as replica:
            if pinned:
                os.sched_setaffinity(0, {cores[0]})
            try:
                row = run_level(
                    replica.url,
                    [replica.verifiers[0].url],
                    sessions,
                    args.rounds,
                    args.draft_n,
                    args.threads,
                    1024,
                )
            finally:
                os.sched_setaffinity(0, own_cores)
            alone[sessions] = row["tokens_per_s"]
    print()
    print("| replicas | sessions per replica | measured, one machine | model, a machine each |")
    print("|---:|---|---:|---:|")
    for count, spread in spreads.items():
        modelled = sum(alone[s] for s in spread if s)
        shown = "/".join(str(s) for s in spread)
        print(f"| {count} | {shown} | {measured[count]:.1f} | {modelled:.1f} |")
    pinning = (
        f"verifier on core {cores[1]}, drafters on core {cores[0]}" if pinned else "not pinned"
    )
    print(
        f"one replica alone ({pinning}): "
        + ", ".join(f"{s} drafters {v:.1f} tok/s" for s, v in alone.items())
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", help="where the drafters send: a balancer or a verifier")
    parser.add_argument(
        "--metrics", help="comma-separated replica URLs to read /metrics from (default: --servers)"
    )
    parser.add_argument(
        "--replicas", help="start this many verifiers behind nginx, e.g. 1,2,3 (no --servers)"
    )
    parser.add_argument(
        "--drafters", default=None, help="drafter counts (default 8 with --replicas, else 1,2,4,8)"
    )
    parser.add_argument("--rounds", type=int, default=30, help="rounds per drafter")
    parser.add_argument("--draft-n", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per model")
    parser.add_argument(
        "--no-model",
        dest="model",
        action="store_false",
        help="with --replicas: skip the one-machine-per-replica model",
    )
    args = parser.parse_args()
    levels = [int(x) for x in (args.drafters or ("8" if args.replicas else "1,2,4,8")).split(",")]
    if args.replicas:
        if args.servers:
            parser.error("--replicas starts its own verifiers: leave out --servers")
        replica_runs(args, levels)
        return
    verifier = None
    url = args.servers
    if url is None:
        verifier = LocalVerifier(verifier_env(args.threads, max(levels)))
        verifier.wait_ready()
        url = verifier.url
    try:
        metrics_urls = args.metrics.split(",") if args.metrics else [url]
        n_ctx = httpx.get(f"{url}/info").json()["n_ctx"]
        print(
            f"verifiers {url}; {args.rounds} rounds per drafter, k = {args.draft_n}, "
            f"{args.threads} thread(s) per model, {os.cpu_count()} cores"
        )
        print_header("servers")
        for n in levels:
            print_row(
                len(metrics_urls),
                run_level(url, metrics_urls, n, args.rounds, args.draft_n, args.threads, n_ctx),
            )
    finally:
        if verifier is not None:
            verifier.stop()


if __name__ == "__main__":
    main()
