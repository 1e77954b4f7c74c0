#!/usr/bin/env python3
"""Verify-round latency against context length: a table, not a test.

Opens one session per context length (prompt_tokens of that length), then times verify
rounds with a k-token draft: the server's llama_decode time and the round trip seen by
the client. With the prefix never re-evaluated, decode time should grow only with the
attention over the cache, not with a re-read of the prompt.

    .venv/bin/python scripts/verify_latency.py --server http://127.0.0.1:8000 --k 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from drafter.client import VerifierClient
from server.shared.protocol import PrefillRequest, VerifyRequest


def measure(
    client: VerifierClient, n_ctx_target: int, k: int, rounds: int
) -> tuple[float, float, float]:
    filler = list(range(1000, 1000 + 97))
    prompt = (filler * (n_ctx_target // len(filler) + 1))[:n_ctx_target]
    session = client.prefill(PrefillRequest(prompt_tokens=prompt, add_bos=False))
    n_past = session.total_tokens
    decode_ms, engine_ms, round_ms = [], [], []
    try:
        for _ in range(rounds):
            began = time.perf_counter()
            result = client.verify(
                VerifyRequest(
                    session_id=session.session_id,
                    n_past=n_past,
                    draft_tokens=[2000 + i for i in range(k)],
                )
            )
            round_ms.append((time.perf_counter() - began) * 1000)
            decode_ms.append(result.timings.decode_ms)
            engine_ms.append(result.timings.engine_ms)
            n_past = result.total_tokens
    finally:
        client.delete_session(session.session_id)
    return (
        statistics.median(decode_ms),
        statistics.median(engine_ms),
        statistics.median(round_ms),
    )


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`--help` with the description as written and every option's default."""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0], formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--server", default="http://127.0.0.1:8000", help="URL of the running verifier."
    )
    parser.add_argument("--k", type=int, default=4, help="Draft tokens per verify round.")
    parser.add_argument(
        "--rounds",
        type=int,
        default=20,
        help="Verify rounds timed per context length (the table shows their medians).",
    )
    parser.add_argument(
        "--lengths",
        default="16,128,512,1024,1800",
        help="Context lengths in tokens, comma-separated (one beyond the verifier's n_ctx "
        "is skipped).",
    )
    args = parser.parse_args()
    with VerifierClient(args.server) as client:
        info = client.info()
        print(
            f"verifier: {info.model} {info.quantization}, n_ctx {info.n_ctx}, k = {args.k}, "
            f"median of {args.rounds} rounds"
        )
        print(
            "| context tokens | llama_decode ms | engine ms | round trip ms "
            "| overhead over engine ms |"
        )
        print("|---:|---:|---:|---:|---:|")
        for length in (int(x) for x in args.lengths.split(",")):
            if length + args.rounds * (args.k + 1) + args.k > info.n_ctx:
                print(f"| {length} | (beyond n_ctx) | | | |")
                continue
            decode, engine, round_trip = measure(client, length, args.k, args.rounds)
            print(
                f"| {length} | {decode:.2f} | {engine:.2f} | {round_trip:.2f} "
                f"| {round_trip - engine:.2f} |"
            )


if __name__ == "__main__":
    main()
