"""What to expect of a GPU verifier and a drafter on another machine, computed on paper
from the project's own cost model, not measured: a round of k drafts commits E(k) tokens
at a per-token acceptance a (server/shared/draft_gain.py), and costs the drafter's k
tokens, the link's round trip and the verifier's pass of k + 1 rows. A pass reads the
weights once: one row costs their size over the memory bandwidth the GPU reaches, and
each further row adds a small share of that while the pass stays memory-bound.

Every input is an option with its default printed above the table: replace them with
your own figures (a measured row time, your drafter's speed, your link's ping)."""

from __future__ import annotations

import argparse

from server.shared.draft_gain import expected_tokens


def round_ms(k: int, row_ms: float, row_cost: float, draft_ms: float, rtt_ms: float) -> float:
    """One round, one after another: k drafts, the link there and back, k + 1 rows."""
    return k * draft_ms + rtt_ms + row_ms * (1 + row_cost * k)


def best_round(
    acceptance: float, row_ms: float, row_cost: float, draft_ms: float, rtt_ms: float
) -> tuple[int, float]:
    """The draft length (1 to 16) with the most tokens a second, and that rate."""
    rates = {
        k: 1000.0 * expected_tokens(acceptance, k) / round_ms(k, row_ms, row_cost, draft_ms, rtt_ms)
        for k in range(1, 17)
    }
    k = max(rates, key=rates.__getitem__)
    return k, rates[k]


def table(args: argparse.Namespace) -> list[str]:
    lines = [
        "| verifier GPU | GB/s | link RTT ms | acceptance | verifier alone tok/s | best k "
        "| drafted tok/s | ratio | `auto` |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for gpu in args.gpu:
        name, _, bandwidth = gpu.partition("=")
        row_ms = 1000.0 * args.verifier_gb / (float(bandwidth) * args.efficiency)
        alone = 1000.0 / row_ms
        for rtt in args.rtt_ms:
            for acceptance in args.acceptance:
                k, rate = best_round(acceptance, row_ms, args.row_cost, args.draft_ms, rtt)
                lines.append(
                    f"| {name} | {float(bandwidth):.0f} | {rtt:g} | {acceptance:g} | "
                    f"{alone:.0f} | {k} | {rate:.0f} | {rate / alone:.2f}x | "
                    f"{'drafts' if rate > alone else 'steps aside'} |"
                )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--gpu",
        action="append",
        help="NAME=GB/s: the verifier GPU's memory bandwidth (repeatable; default: an H100 "
        "SXM's 3350 and a DGX Spark's 273).",
    )
    parser.add_argument(
        "--verifier-gb",
        type=float,
        default=8.54,
        help="The verifier's weights, GB (Llama 3.1 8B Q8_0).",
    )
    parser.add_argument(
        "--efficiency", type=float, default=0.7, help="The share of the bandwidth a decode reaches."
    )
    parser.add_argument(
        "--row-cost",
        type=float,
        default=0.03,
        help="What each row past the first adds to a pass, in rows.",
    )
    parser.add_argument(
        "--draft-ms",
        type=float,
        default=8.0,
        help="The drafter's time a token, ms (Llama 3.2 1B Q4_K_M on an Apple Silicon GPU).",
    )
    parser.add_argument(
        "--rtt-ms",
        type=float,
        nargs="+",
        default=[1.0, 5.0, 30.0],
        help="The link's round trip with the protocol's own time, ms (wired, Wi-Fi, a tunnel).",
    )
    parser.add_argument(
        "--acceptance",
        type=float,
        nargs="+",
        default=[0.6, 0.8],
        help="The per-token acceptance of the drafts.",
    )
    args = parser.parse_args()
    args.gpu = args.gpu or ["H100=3350", "DGX Spark=273"]
    print(
        f"Computed, not measured: verifier {args.verifier_gb:g} GB at {args.efficiency:g} of the "
        f"bandwidth, each further row {args.row_cost:g} of a row, drafts {args.draft_ms:g} ms "
        "a token, one round after another (no pipelining). Where no draft pays, `auto` "
        "steps aside: rounds without a draft ask for chunks of the verifier's own tokens, "
        "near its speed alone.\n"
    )
    print("\n".join(table(args)))


if __name__ == "__main__":
    main()
