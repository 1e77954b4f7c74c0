#!/usr/bin/env python3
"""Can one client of `serve` learn another's text from the drafter's history? A probe,
not a test: a table of whether a secret was recovered, for each history scope.

Client A sends a prompt that ends in a PIN. Client B knows the text before the PIN and
has a list of candidate PINs (the right one among decoys): each guess is a prompt of that
text and a candidate, and B reads its own answer's `speculative.accepted`. Where B's
requests are drafted from a history that holds A's text, the right guess is A's prompt
again, and A's answer, drafted from the history, is accepted; a wrong one has no such
draft. A calibration request (the known text and a character no PIN holds) gives the
figure a guess must exceed. `serve` runs on 127.0.0.1 with client keys, as a team shares
one endpoint: one key for both clients, or for scope `key` one each. The verifier and
`serve` are started here, one thread each.

    .venv/bin/python scripts/history_probe.py                      # user (before), auto
    .venv/bin/python scripts/history_probe.py --scope key --scope none
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from drafter.principals import resolve_history_scope  # noqa: E402
from drafter.settings import HistoryScope  # noqa: E402
from scripts.harness.cli import HelpFormatter, first_paragraph  # noqa: E402
from scripts.harness.local import LocalServe, LocalVerifier  # noqa: E402
from server.shared.defaults import DEFAULT_DRAFTER_MODEL, DEFAULT_VERIFIER_MODEL  # noqa: E402

# What B knows of A's text: well over the 12 tokens a history draft needs to match.
KNOWN = (
    "Front desk memo, confidential. The door code that Dana Whitfield uses for the "
    "north lab this week is"
)
CONTROL = " -"  # no PIN goes on so: what a request drafts without A's text
# Accepted tokens past the calibration's that mark a history draft: more than the few a
# chance draft of the model's may add.
MARGIN = 4


@dataclass
class Outcome:
    scope: str
    resolved: str
    guesses: int  # B's guesses sent, the calibration request not counted
    recovered: bool
    requests: int | None  # B's requests, calibration included, until the PIN was known


def complete(client: httpx.Client, key: str, prompt: str, max_tokens: int) -> dict:
    response = client.post(
        "/completions",
        headers={"authorization": f"Bearer {key}"},
        json={
            "model": "any",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stop": ["<never>"],
        },
    )
    response.raise_for_status()
    return response.json()["speculative"]


def candidates(secret: str, n: int, seed: int) -> list[str]:
    """`n` PINs of the secret's length, the secret among them at a random place."""
    rng = random.Random(seed)
    decoys: list[str] = []
    while len(decoys) < n - 1:
        pin = "".join(rng.choice("0123456789") for _ in secret)
        if pin != secret and pin not in decoys:
            decoys.append(pin)
    decoys.insert(rng.randrange(n), secret)
    return decoys


def probe(serve_url: str, keys: tuple[str, str], guesses: list[str], secret: str, max_tokens: int):
    """A's request, then B's guesses until one stands out: (guesses sent, the PIN B
    took for A's or None, B's requests)."""
    key_a, key_b = keys
    with httpx.Client(base_url=serve_url, timeout=300) as client:
        complete(client, key_a, f"{KNOWN} {secret}", max_tokens)
        baseline = complete(client, key_b, KNOWN + CONTROL, max_tokens)["accepted"]
        for sent, pin in enumerate(guesses, start=1):
            if (
                complete(client, key_b, f"{KNOWN} {pin}", max_tokens)["accepted"]
                >= baseline + MARGIN
            ):
                return sent, pin, sent + 1
    return len(guesses), None, len(guesses) + 1


def run_scope(scope: str, verifier_url: str, args: argparse.Namespace) -> Outcome:
    keys = ("sk-dana", "sk-mallory") if scope == "key" else ("sk-team", "sk-team")
    key_arg = ",".join(dict.fromkeys(keys))
    resolved = resolve_history_scope(
        HistoryScope(scope), host="127.0.0.1", keyed=True, any_origin=False
    )
    serve = LocalServe(
        verifier_url,
        "--serve-api-key",
        key_arg,
        "--history-scope",
        scope,
        "--drafter",
        args.drafter,
        threads=1,
        loaded=True,
        timeout=300,
    )
    pins = candidates(args.secret, args.candidates, args.seed)
    try:
        sent, found, requests = probe(serve.url, keys, pins, args.secret, args.max_tokens)
    finally:
        serve.stop()
    recovered = found == args.secret
    print(f"  {scope}: B took {found!r} for A's PIN after {requests} requests", file=sys.stderr)
    return Outcome(scope, str(resolved), sent, recovered, requests if recovered else None)


def table(outcomes: list[Outcome]) -> str:
    lines = [
        "| scope | resolved | guesses sent | secret recovered | requests to recover |",
        "|---|---|---:|---|---:|",
    ]
    for o in outcomes:
        needed = "-" if o.requests is None else str(o.requests)
        recovered = "yes" if o.recovered else "no"
        lines.append(f"| {o.scope} | {o.resolved} | {o.guesses} | {recovered} | {needed} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=first_paragraph(__doc__), formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--scope",
        action="append",
        choices=[s.value for s in HistoryScope],
        help="A history scope to probe `serve` with (repeat for several; default: user, "
        "what a serve with a key shared did before scopes, and auto, the default now).",
    )
    parser.add_argument(
        "--secret", default="482915", help="The PIN client A's request holds (digits)."
    )
    parser.add_argument(
        "--candidates", type=int, default=20, help="PINs B guesses from, the right one among them."
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="Seed of the decoy PINs and of the right one's place."
    )
    parser.add_argument(
        "--max-tokens", type=int, default=16, help="Tokens each request generates at most."
    )
    parser.add_argument(
        "--drafter", default="model+history", help="The drafter `serve` runs (--drafter)."
    )
    parser.add_argument(
        "--verifier-model",
        type=Path,
        default=DEFAULT_VERIFIER_MODEL,
        help="GGUF file the local verifier serves.",
    )
    parser.add_argument(
        "--drafter-model",
        type=Path,
        default=DEFAULT_DRAFTER_MODEL,
        help="GGUF file of the draft model `serve` uses, unless the environment sets "
        "DRAFTER_MODEL.",
    )
    args = parser.parse_args(argv)
    if not args.secret.isdigit() or args.candidates < 1:
        parser.error("--secret takes digits, and --candidates at least 1")
    if 10 ** len(args.secret) < args.candidates:
        parser.error("--candidates is more than there are PINs of --secret's length")
    os.environ.setdefault("DRAFTER_MODEL", str(args.drafter_model))
    verifier = LocalVerifier(
        {
            "VERIFIER_MODEL_PATH": str(args.verifier_model),
            "VERIFIER_N_THREADS": "1",
            "VERIFIER_N_CTX": "1024",
        }
    )
    outcomes = []
    try:
        verifier.wait_ready(timeout=300)
        for scope in args.scope or ["user", "auto"]:
            outcomes.append(run_scope(scope, verifier.url, args))
    finally:
        verifier.stop()
    print(table(outcomes))


if __name__ == "__main__":
    main()
