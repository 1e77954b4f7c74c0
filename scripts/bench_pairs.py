#!/usr/bin/env python3
"""Model pairs on the same prompts: acceptance, tokens per round, and for a pair that
drafts through text, the time translation takes per round (committed text to the
drafter's tokens, the draft back to the verifier's ids). A table, not a test.

    .venv/bin/python scripts/bench_pairs.py --server http://127.0.0.1:8000
Without --server it starts the default verifier on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from drafter.client import VerifierClient
from drafter.drafters.model import DraftModel
from drafter.drafters.translate import TranslatingDrafter
from drafter.runner import load_verifier_vocab
from drafter.speculative.loop import SpeculativeLoop
from scripts.harness.cli import HelpFormatter, first_paragraph
from scripts.harness.local import LocalVerifier
from server.shared.defaults import MODELS_DIR
from server.shared.protocol import PrefillRequest

PROMPTS = [
    "The rules of chess say that",
    "def fibonacci(n):\n",
    "Shopping list:\n1.",
    "In 1969, the first humans",
    "<|im_start|>user\nName three rivers in Europe.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
]
DRAFTERS = {
    "SmolLM2 135M Q4_K_M (same vocabulary)": "smollm2-135m-instruct-q4_k_m.gguf",
    "Gemma 3 270M Q4_K_M (translated)": "gemma-3-270m-q4_k_m.gguf",
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=first_paragraph(__doc__), formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--server",
        help="URL of the verifier to draft against; None: start the default verifier on "
        "127.0.0.1 with --threads threads.",
    )
    parser.add_argument(
        "--tokens", type=int, default=64, help="Tokens to generate for each prompt."
    )
    parser.add_argument("--draft-n", type=int, default=4, help="Tokens drafted per round (k).")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads per draft model, and for the verifier this script starts.",
    )
    args = parser.parse_args()
    verifier = None
    url = args.server
    if url is None:
        verifier = LocalVerifier({"VERIFIER_N_THREADS": str(args.threads)})
        verifier.wait_ready()
        url = verifier.url
    try:
        with VerifierClient(url, timeout=300) as client:
            info = client.info()
            print(
                f"verifier {info.model} ({info.quantization}), greedy, k = {args.draft_n}, "
                f"{args.tokens} tokens for each of {len(PROMPTS)} prompts"
            )
            print(
                "| drafter | acceptance | tokens per round | draft ms per round "
                "| of which translation ms | boundary misses |"
            )
            print("|---|---:|---:|---:|---:|---:|")
            for label, file in DRAFTERS.items():
                model = DraftModel(
                    MODELS_DIR / file, n_ctx=info.n_ctx + 256, n_threads=args.threads
                )
                target = None
                drafter = model
                if model.vocab_facts().hash != info.vocab_hash:
                    target = load_verifier_vocab(client, info)
                    drafter = TranslatingDrafter(model, target)
                drafted = accepted = rounds = 0
                draft_s = 0.0
                for prompt in PROMPTS:
                    model.reset()
                    loop = SpeculativeLoop(drafter, client, draft_n=args.draft_n, n_ctx=info.n_ctx)
                    for _ in loop.run(PrefillRequest(prompt=prompt), args.tokens):
                        pass
                    stats = loop.result.stats
                    drafted += stats.drafted
                    accepted += stats.accepted
                    rounds += stats.rounds
                    draft_s += stats.draft_time_s
                generated = accepted + rounds
                translate_ms = getattr(drafter, "translate_s", 0.0) * 1000 / rounds
                misses = getattr(drafter, "boundary_misses", 0)
                print(
                    f"| {label} | {accepted / drafted:.1%} | {generated / rounds:.2f} | "
                    f"{draft_s * 1000 / rounds:.1f} | {translate_ms:.2f} | {misses} |",
                    flush=True,
                )
                if target is not None:
                    target.close()
                model.close()
    finally:
        if verifier is not None:
            verifier.stop()


if __name__ == "__main__":
    main()
