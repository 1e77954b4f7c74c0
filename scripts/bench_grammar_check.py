#!/usr/bin/env python3
"""What reading a large grammar costs before llguidance compiles it: GBNF's conversion to
Lark and the "can never end" check (server/shared/grammar_ends.py), as the verifier does
them now and as it did before issue 64 (llguidance's own conversion, Lark's own loading),
on a chain of GBNF rules and a chain of Lark terminals. Seconds, not a test.

    .venv/bin/python scripts/bench_grammar_check.py --rules 1600
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import llguidance
from lark.load_grammar import GrammarBuilder

from scripts.harness.cli import HelpFormatter, first_paragraph
from server.shared.constraint import compile_grammar
from server.shared.grammar_ends import never_ends


def chained_gbnf(n: int) -> str:
    lines = [f'r{i} ::= "ab" r{i + 1} | "cd"' for i in range(n)]
    return "\n".join(["root ::= r0", *lines, f'r{n} ::= "z"'])


def chained_lark_terminals(n: int) -> str:
    lines = [f'T{i}: "ab" T{i + 1} | "cd"' for i in range(n)]
    return "\n".join(["start: T0", *lines, f'T{n}: "z"'])


def seconds(work) -> float:
    began = time.perf_counter()
    work()
    return time.perf_counter() - began


def before(kind: str, text: str) -> None:
    """The check as it was: llguidance's conversion, then Lark's loader."""
    grammar = llguidance.grammar_from(kind, text)
    GrammarBuilder().load_grammar(grammar.split("\n", 1)[1] if kind == "gbnf" else grammar)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=first_paragraph(__doc__), formatter_class=HelpFormatter
    )
    parser.add_argument("--rules", type=int, default=1600, help="Rules in each chain.")
    parser.add_argument(
        "--skip-before", action="store_true", help="Time only the check as it is now."
    )
    args = parser.parse_args()
    for kind, text in (
        ("gbnf", chained_gbnf(args.rules)),
        ("lark", chained_lark_terminals(args.rules)),
    ):
        now = seconds(lambda k=kind, t=text: never_ends(k, compile_grammar(k, t)))
        line = f"{kind}: {len(text)} characters, {args.rules} rules: now {now:.2f} s"
        if not args.skip_before:
            line += f", before {seconds(lambda k=kind, t=text: before(k, t)):.2f} s"
        print(line, flush=True)


if __name__ == "__main__":
    main()
