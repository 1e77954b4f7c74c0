#!/usr/bin/env python3
"""Load test: many drafters against one verifier, or against replicas behind nginx. A
table, not a test.

For each verifier (this checkout's; with `--compare-setting NAME=VALUE` this checkout's
again with that setting; with `--compare-with DIR` another checkout's; all in the same
run), each drafter count and each k it prints: aggregate tokens/s, round latency, and
from the verifier's /metrics what its decodes were: forward passes per llama_decode
(1.00: every decode one pass), rows per pass, the share of those rows that only shaped
the pass (padding, fillers), sessions per pass, rounds per cycle (an engine step of
rounds: one decode or more, as sessions far apart in the KV cache take passes of their
own), and decode time per row (what the machine gave the verifier: a row of the same
passes costs more when something else takes the core). `--fairness` adds two keys:
one drafter of one key beside many of another, whose 2,000-token prompt arrives
meanwhile; it reports the lone key's rounds before and during that prompt. With
`--repeats N` every verifier runs N times, alternating, and a table of medians follows.

    .venv/bin/python scripts/loadtest.py                          # replayed drafts
    .venv/bin/python scripts/loadtest.py --drafters 1,8,16 --draft-n 4,auto \\
        --compare-setting VERIFIER_GATHER_ROUNDS=false --compare-with /tmp/before --fairness
    .venv/bin/python scripts/loadtest.py --drafter model --drafters 1,4,8
    .venv/bin/python scripts/loadtest.py --replicas 1,2,3 --drafters 8

Drafters and verifiers share this machine: the verifier is pinned to one core and the
drafters to another (`taskset`, when there are two). See scripts/harness/load.py for the
two kinds of drafter.
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
from scripts.harness.load import MISSES, PROMPTS, LevelResult, run_drafters
from scripts.harness.local import LocalVerifier
from scripts.harness.replicas import LocalReplicas
from server.shared.protocol import PrefillRequest
from server.verifier.settings import VerifierSettings

KEYS = ("alice-load-test-key", "mallory-load-test-key")
LONG_PROMPT = "The history of the bicycle begins " * 285  # about 2,000 tokens
N_CTX = 1024


def verifier_env(threads: int, sessions: int, n_ctx: int = N_CTX) -> dict[str, str]:
    return {
        "VERIFIER_MAX_SESSIONS": str(sessions),
        "VERIFIER_N_THREADS": str(threads),
        "VERIFIER_N_CTX": str(n_ctx),
        "VERIFIER_MAX_QUEUE": str(4 * sessions + 8),
    }


def cores_and_prefix() -> tuple[list[int], tuple[str, ...]]:
    cores = sorted(os.sched_getaffinity(0))[:2] if hasattr(os, "sched_getaffinity") else []
    if len(cores) == 2 and shutil.which("taskset"):
        return cores, ("taskset", "-c", str(cores[1]))
    return [], ()


def pass_columns(row: LevelResult) -> str:
    decodes = row.delta("verifier_decodes_total", kind="rounds")
    if not decodes:  # a verifier that does not count passes (an older version)
        return "n/a | n/a | n/a | n/a | n/a | n/a"
    passes = row.delta("verifier_forward_passes_total", kind="rounds")
    rows = row.delta("verifier_pass_rows_sum", kind="rounds")
    shaping = row.delta("verifier_shaping_rows_total", kind="rounds")
    sessions = row.delta("verifier_pass_sessions_sum") / decodes
    cycles = row.delta("verifier_cycle_rounds_count")
    per_cycle = f"{row.delta('verifier_cycle_rounds_sum') / cycles:.2f}" if cycles else "n/a"
    decode_s = row.delta("verifier_decode_seconds_sum", kind="rounds")
    return (
        f"{passes / decodes:.2f} | {rows / passes:.1f} | {100 * shaping / max(rows, 1):.0f}% "
        f"| {sessions:.2f} | {per_cycle} | {1000 * decode_s / max(rows, 1):.1f}"
    )


def print_row(label: str, k: object, row: LevelResult) -> None:
    check = "yes" if not row.mismatches else f"NO ({row.mismatches})"
    print(
        f"| {label} | {row.drafters} | {k} | {row.tokens_per_s:.1f} | {row.p50_ms:.0f} | "
        f"{row.latency_ms(0.99):.0f} | {pass_columns(row)} | {len(row.errors)} | {check} |",
        flush=True,
    )
    if row.errors:
        print(f"    first error: {row.errors[0]}")


def level_runs(args: argparse.Namespace, levels: list[int], ks: list[object]) -> None:
    cores, prefix = cores_and_prefix()
    own_cores = os.sched_getaffinity(0)
    where = f"verifier on core {cores[1]}, drafters on core {cores[0]}" if cores else "unpinned"
    print(
        f"{args.drafter} drafters"
        + (
            f" ({args.misses} misses, {args.draft_token_ms:g} ms a draft token)"
            if args.drafter == "replay"
            else ""
        )
        + f", {args.rounds} rounds each, {args.threads} thread(s) per "
        f"model, {where}, {os.cpu_count()} cores"
    )
    print(
        "| verifier | drafters | k | aggregate tokens/s | p50 round ms | p99 round ms | "
        "passes per decode | rows per pass | shaping rows | sessions per pass | rounds per cycle "
        "| decode ms per row | errors | output = /generate |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    env = verifier_env(args.threads, args.sessions or max(levels))
    variants = [("this", None, env)]
    for setting in args.compare_setting:
        name, _, value = setting.partition("=")
        variants.append((f"this, {setting}", None, {**env, name: value}))
    if args.compare_with:
        variants.append(("compared", Path(args.compare_with).resolve(), env))
    rates: dict[tuple[str, object, int], list[float]] = {}
    for _ in range(args.repeats):  # the variants alternate, run after run
        for label, source, variant_env in variants:
            with LocalVerifier(variant_env, command_prefix=prefix, source=source) as verifier:
                if cores:
                    os.sched_setaffinity(0, {cores[0]})
                try:
                    for k in ks:
                        for n in levels:
                            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
                            row = run_drafters(
                                verifier.url,
                                [verifier.url],
                                prompts,
                                rounds=args.rounds,
                                draft_n=k,
                                drafter=args.drafter,
                                threads=args.threads,
                                draft_token_s=args.draft_token_ms / 1000.0,
                                misses=args.misses,
                            )
                            print_row(label, k, row)
                            rates.setdefault((label, k, n), []).append(row.tokens_per_s)
                finally:
                    if cores:
                        os.sched_setaffinity(0, own_cores)
    if args.repeats > 1:
        print_medians(rates, args.repeats)


def print_medians(rates: dict[tuple[str, object, int], list[float]], repeats: int) -> None:
    """Each variant's median aggregate tokens/s over the alternating runs, and its ratio
    to this checkout's verifier with its default settings."""
    print(f"\nmedian of {repeats} alternating runs")
    print("| verifier | drafters | k | median tokens/s | min | max | against `this` |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for (label, k, n), values in rates.items():
        base = statistics.median(rates[("this", k, n)])
        median = statistics.median(values)
        print(
            f"| {label} | {n} | {k} | {median:.1f} | {min(values):.1f} | {max(values):.1f} "
            f"| {median / base:.2f}x |"
        )


def fairness_run(args: argparse.Namespace) -> None:
    """alice: one drafter; mallory: eight, and a 2,000-token prompt while they run."""
    cores, prefix = cores_and_prefix()
    env = {
        **verifier_env(args.threads, 10, n_ctx=2304),
        "VERIFIER_API_KEYS": ",".join(KEYS),
        "VERIFIER_ADMIN_API_KEYS": KEYS[0],
    }
    prompts = [PROMPTS[0]] + [PROMPTS[1 + i % 7] for i in range(8)]
    keys = [KEYS[0]] + [KEYS[1]] * 8
    with LocalVerifier(env, command_prefix=prefix) as verifier:
        if cores:
            os.sched_setaffinity(0, {cores[0]})
        prefill_span: list[float] = []

        def long_prompt() -> None:
            time.sleep(1.0)  # once the rounds are going
            with VerifierClient(verifier.url, timeout=600, api_key=KEYS[1]) as client:
                prefill_span.append(time.perf_counter())
                opened = client.prefill(PrefillRequest(prompt=LONG_PROMPT))
                prefill_span.append(time.perf_counter())
                client.delete_session(opened.session_id)

        alone = run_drafters(
            verifier.url,
            [verifier.url],
            prompts[:1],
            rounds=args.rounds,
            draft_n=4,
            api_keys=keys[:1],
            metrics_key=KEYS[0],
        )
        shared = run_drafters(
            verifier.url,
            [verifier.url],
            prompts,
            rounds=args.rounds * 3,
            draft_n=4,
            api_keys=keys,
            metrics_key=KEYS[0],
            during=long_prompt,
        )
    chunk_s = shared.delta("verifier_decode_seconds_sum", kind="prompt") / max(
        1.0, shared.delta("verifier_decode_seconds_count", kind="prompt")
    )
    rounds_s = shared.delta("verifier_decode_seconds_sum", kind="rounds") / max(
        1.0, shared.delta("verifier_decode_seconds_count", kind="rounds")
    )
    print()
    print("| alice's rounds (one drafter, key A) | p50 ms | max ms |")
    print("|---|---:|---:|")
    print(f"| alone | {alone.p50_ms:.0f} | {alone.latency_ms(1.0):.0f} |")
    during = _alice_during(shared, prefill_span)
    print(f"| beside 8 drafters of key B, and B's 2,000-token prompt | {during} |")
    print(
        f"one prompt chunk decode: {1000 * chunk_s:.0f} ms on average; a decode of rounds "
        f"{1000 * rounds_s:.0f} ms; B's prompt took {prefill_span[1] - prefill_span[0]:.1f} s"
        if len(prefill_span) == 2
        else "B's prompt did not run"
    )


def _alice_during(shared: LevelResult, span: list[float]) -> str:
    """p50 and max of alice's rounds sent while B's prompt was being evaluated."""
    if len(span) != 2:
        return "n/a | n/a"
    during = sorted(s for sent, s in shared.rounds[0] if span[0] <= sent <= span[1])
    if not during:
        return "n/a | n/a"
    return f"{during[len(during) // 2] * 1000:.0f} | {during[-1] * 1000:.0f}"


def replica_runs(args: argparse.Namespace, levels: list[int]) -> None:
    max_body = VerifierSettings().max_body_bytes
    print(f"{args.rounds} rounds per drafter, every process on this machine, nginx in front")
    print("| replicas | drafters | aggregate tokens/s | p50 round ms | p99 round ms | errors |")
    print("|---:|---:|---:|---:|---:|---:|")
    for count in [int(x) for x in args.replicas.split(",")]:
        env = verifier_env(args.threads, args.sessions or max(levels))
        with LocalReplicas(count, env, max_body) as replicas:
            urls = [v.url for v in replicas.verifiers]
            for n in levels:
                prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
                row = run_drafters(
                    replicas.url,
                    urls,
                    prompts,
                    rounds=args.rounds,
                    draft_n=4,
                    drafter=args.drafter,
                    threads=args.threads,
                )
                print(
                    f"| {count} | {n} | {row.tokens_per_s:.1f} | {row.p50_ms:.0f} | "
                    f"{row.latency_ms(0.99):.0f} | {len(row.errors)} |",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=first_paragraph(__doc__), formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--drafters",
        default="1,8,16",
        help="Drafter counts to run, comma-separated, e.g. 1,8,16.",
    )
    parser.add_argument(
        "--draft-n",
        default="4",
        help="Draft lengths (k) to run, comma-separated, e.g. 4,auto (the replica runs "
        "always use 4).",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=30,
        help="Verify rounds per drafter (three times as many in the fairness run's shared part).",
    )
    parser.add_argument(
        "--drafter",
        choices=["replay", "model"],
        default="replay",
        help="Who drafts: replay (the verifier's own tokens, every few wrong, at no "
        "drafting cost) or model (the draft model, competing for this machine's cores).",
    )
    parser.add_argument(
        "--draft-token-ms",
        type=float,
        default=0.0,
        help="What a replayed drafter spends on each draft token, in ms (asleep, as a "
        "drafter on a machine of its own: a Metal Q4_K_M drafter's few ms); 0: nothing.",
    )
    parser.add_argument(
        "--misses",
        choices=MISSES,
        default="periodic",
        help="Which replayed draft tokens are wrong, one in 4: every fourth (a round of 3 "
        "drafts is taken whole), or drawn at random once (a real drafter's rounds).",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads per model: the verifier's and the draft model's.",
    )
    parser.add_argument(
        "--compare-with",
        metavar="DIR",
        help="Another checkout of this repository whose verifier to run too, in the same "
        "table (not with --replicas); None: only this checkout's.",
    )
    parser.add_argument(
        "--compare-setting",
        metavar="NAME=VALUE",
        action="append",
        default=[],
        help="Run this checkout's verifier again with this setting (an environment "
        "variable, e.g. VERIFIER_GATHER_ROUNDS=false), in the same table; repeatable.",
    )
    parser.add_argument(
        "--sessions",
        type=int,
        help="The verifier's sessions (KV sequences); None: as many as the most drafters. "
        "More sessions than drafters leaves room for gaps between their sequences.",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="Runs of every verifier, alternating (this, each compared one, this again, "
        "...); above 1, a table of each one's median tokens/s follows.",
    )
    parser.add_argument(
        "--fairness",
        action="store_true",
        help="Add the two-key run: one drafter of key A beside eight of key B, whose "
        "2,000-token prompt arrives meanwhile (not with --replicas).",
    )
    parser.add_argument(
        "--replicas",
        help="Replica counts to run instead, comma-separated, e.g. 1,2,3: that many "
        "verifiers behind nginx per run; None: one verifier, no nginx.",
    )
    args = parser.parse_args()
    levels = [int(x) for x in args.drafters.split(",")]
    ks: list[object] = [x if x == "auto" else int(x) for x in args.draft_n.split(",")]
    if args.replicas:
        replica_runs(args, levels)
        return
    level_runs(args, levels, ks)
    if args.fairness:
        fairness_run(args)


if __name__ == "__main__":
    main()
