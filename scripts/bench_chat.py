#!/usr/bin/env python3
"""A multi-turn conversation replayed through `draft_token_generator serve`, as a chat
app sends it (the whole history every turn): a table, not a test.

A long first message, then short follow-ups. Per turn: prompt tokens, the tokens the
verifier reused (`usage.prompt_tokens_details.cached_tokens`) and the draft model found
in its own cache, time to first token, and tokens/s after it. Five verifier setups, one
after the other in the same run:

- tiled (the default): each stretch of a prompt between the model's earlier answers
  with at least 64 tokens in passes of 64 rows or more (up to n_batch), a shorter one
  in one pass padded to 64 rows where that costs less than its rows below the tile (late
  in a long chat), the others and the answers in passes of fewer; prompt reuse on
  (docs/numerics.md);
- short stretches below the tile: `VERIFIER_PROMPT_PAD=off`, no stretch padded;
- answers as text: `VERIFIER_PROMPT_REPLIES_BELOW_TILE=false`, the whole prompt one
  stretch (its earlier answers tiled too);
- 48-token chunks: `VERIFIER_PROMPT_TILE_ROWS=0`, every prompt cut into chunks below the
  CPU build's 64-row tile, prompt reuse on;
- reuse off, same cuts: what reuse alone saves (its text must equal the default's);
- reuse off, n_batch cuts: `VERIFIER_PREFIX_CACHE=false VERIFIER_PROMPT_TILE_ROWS=0`,
  whole prompts in n_batch chunks, as llama.cpp's own server evaluates them.

Between turns the script waits `--pause` seconds, a user reading the answer (0: an
agent that replies at once). With answers read as text, the idle verifier evaluates the
answer again as the next prompt will (tiled), so that the next turn keeps it if it
comes after that. Each setup also answers a short fresh prompt, the time to first token to
compare with. Verifier and drafter are pinned to one core each (`taskset`), one thread
per model.

    .venv/bin/python scripts/bench_chat.py
    .venv/bin/python scripts/bench_chat.py --turns 2 --max-tokens 16     # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from scripts.harness.cli import HelpFormatter, first_paragraph  # noqa: E402
from scripts.harness.local import LocalServe, LocalVerifier  # noqa: E402
from server.shared.defaults import DEFAULT_DRAFTER_MODEL, DEFAULT_VERIFIER_MODEL  # noqa: E402

# About 800 tokens of pasted text, then a question: the first message of the trial.
DOCUMENT = " ".join(
    [
        "The verifier keeps one key-value cache per session, so a round costs one pass over "
        "the draft and the pending token whatever the length of the context. When a session "
        "ends, its cache stays behind as a prefix that the same client's next prompt may "
        "take up again, trimmed to the tokens the two have in common."
    ]
    * 12
)
TURNS = [
    f"Here are my notes:\n\n{DOCUMENT}\n\nSummarise them in two sentences.",
    "Shorter, please.",
    "What does the second sentence mean?",
    "Thanks. One more time, in plain words.",
]
FRESH = "Say hello."
SETUPS = {
    "tiled (default)": {},
    "short stretches below the tile": {"PROMPT_PAD": "off"},
    "answers as text": {"PROMPT_REPLIES_BELOW_TILE": "false"},
    "48-token chunks": {"PROMPT_TILE_ROWS": "0"},
    "reuse off, same cuts": {"PREFIX_CACHE": "false", "PROMPT_CHUNK": "{chunk}"},
    "reuse off, n_batch cuts": {"PREFIX_CACHE": "false", "PROMPT_TILE_ROWS": "0"},
}


def pin(core: int | None) -> list[str]:
    if core is None or shutil.which("taskset") is None:
        return []
    return ["taskset", "-c", str(core)]


def ask(url: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat turn: its text, usage, and times."""
    body = {
        "model": "any",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    began = time.perf_counter()
    first = None
    text, usage, speculative = [], {}, {}
    with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    first = first or time.perf_counter()
                    text.append(content)
            usage = chunk.get("usage") or usage
            speculative = chunk.get("speculative") or speculative
    done = time.perf_counter()
    first = first or done
    completion = usage["completion_tokens"]
    return {
        "text": "".join(text),
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
        "draft_cached_tokens": speculative.get("draft_cached_tokens", 0),
        "ttft_s": first - began,
        "tokens_per_s": (completion - 1) / (done - first) if done > first else 0.0,
    }


def run_setup(name: str, env: dict, args) -> tuple[list[dict], dict]:
    """The conversation and a fresh prompt through one verifier setup; and its /info."""
    verifier = LocalVerifier(
        {
            "VERIFIER_MODEL_PATH": str(args.verifier_model),
            "VERIFIER_N_THREADS": "1",
            "VERIFIER_N_CTX": "2048",
            **{f"VERIFIER_{k}": v for k, v in env.items()},
        },
        command_prefix=pin(args.verifier_core),
    )
    try:
        verifier.wait_ready(timeout=300)
        info = httpx.get(f"{verifier.url}/info").json()
        serve = LocalServe(
            verifier.url, threads=1, command_prefix=pin(args.drafter_core), loaded=True
        )
        try:
            rows = []
            messages: list[dict] = []
            for i, question in enumerate(TURNS[: args.turns], start=1):
                messages.append({"role": "user", "content": question})
                row = ask(serve.url, messages, args.max_tokens)
                messages.append({"role": "assistant", "content": row["text"]})
                rows.append({"setup": name, "turn": str(i), **row})
                print(f"  {name}: turn {i} ttft {row['ttft_s']:.2f} s", file=sys.stderr)
                time.sleep(args.pause)
            fresh = ask(serve.url, [{"role": "user", "content": FRESH}], args.max_tokens)
            rows.append({"setup": name, "turn": "fresh", **fresh})
            return rows, info
        finally:
            serve.stop()
    finally:
        verifier.stop()


def table(rows: list[dict]) -> str:
    lines = [
        "| setup | turn | prompt tokens | verifier cached | drafter cached | TTFT s | tok/s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['setup']} | {r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | "
            f"{r['draft_cached_tokens']} | {r['ttft_s']:.2f} | {r['tokens_per_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=first_paragraph(__doc__), formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--turns",
        type=int,
        default=len(TURNS),
        choices=range(1, 5),
        help="Conversation turns to replay: the long first message, then short follow-ups.",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="Tokens to generate at most per answer."
    )
    parser.add_argument(
        "--pause",
        type=float,
        default=2.0,
        help="Seconds between a turn's answer and the next question (a user reading it).",
    )
    parser.add_argument(
        "--setup",
        action="append",
        choices=list(SETUPS),
        help="A verifier setup to run (repeat for several; default: every one).",
    )
    parser.add_argument(
        "--verifier-model",
        type=Path,
        default=DEFAULT_VERIFIER_MODEL,
        help="GGUF file the local verifiers serve.",
    )
    parser.add_argument(
        "--drafter-model",
        type=Path,
        default=DEFAULT_DRAFTER_MODEL,
        help="GGUF file of the draft model `serve` uses, unless the environment sets "
        "DRAFTER_MODEL.",
    )
    parser.add_argument(
        "--verifier-core",
        type=int,
        default=1,
        help="CPU core the verifier is pinned to with taskset (unpinned without taskset).",
    )
    parser.add_argument(
        "--drafter-core",
        type=int,
        default=0,
        help="CPU core `serve` is pinned to with taskset (unpinned without taskset).",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("DRAFTER_MODEL", str(args.drafter_model))
    rows: list[dict] = []
    chunk = None
    for name in args.setup or list(SETUPS):
        env = SETUPS[name]
        env = {k: v.format(chunk=chunk) for k, v in env.items()}
        print(f"{name} ({env or 'defaults'})", file=sys.stderr)
        setup_rows, info = run_setup(name, env, args)
        rows += setup_rows
        chunk = chunk or info["prompt_chunk"]  # the default's, for the same-cuts setup
        print(f"  prompt_chunk {info['prompt_chunk']}", file=sys.stderr)
    print(table(rows))
    # Reuse must not change a token where prompts are cut alike; other cuts are other
    # numbers (server/verifier/probe/invariance.py), so those setups' texts may differ.
    same_cuts = [r for r in rows if r["setup"] in ("tiled (default)", "reuse off, same cuts")]
    texts: dict[str, set[str]] = {}
    for r in same_cuts:
        texts.setdefault(r["turn"], set()).add(r["text"])
    if {r["setup"] for r in same_cuts} == {"tiled (default)", "reuse off, same cuts"}:
        print(
            f"\nreuse on and off (same cuts) gave the same text every turn: "
            f"{all(len(t) == 1 for t in texts.values())}"
        )


if __name__ == "__main__":
    main()
