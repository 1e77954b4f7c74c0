#!/usr/bin/env python
"""What masking one row of logits by a grammar costs, with llguidance (what the verifier
uses, server/shared/constraint.py) and with llama.cpp's own grammar sampler, over the
default verifier's vocabulary: the mask at each position of a JSON answer, the median.
A round masks k + 1 rows. With --acceptance, also how many drafts the verifier accepts
under a JSON schema when the draft model drafts under it too, and when it drafts free
(a verifier on 127.0.0.1, the default pair, greedy, k = 4). Tables, not tests.

    .venv/bin/python scripts/bench_grammar.py --acceptance
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

# The benchmark drives llama.cpp's grammar sampler directly: the project itself never
# uses it, so the one module that wraps llama.cpp (server/shared/runtime.py) does not.
import llama_cpp  # noqa: E402
import numpy as np  # noqa: E402
from llama_cpp.llama_grammar import json_schema_to_gbnf  # noqa: E402

from scripts.harness.cli import HelpFormatter, first_paragraph  # noqa: E402
from server.shared.defaults import DEFAULT_VERIFIER_MODEL  # noqa: E402
from server.shared.grammars import Grammars  # noqa: E402
from server.shared.runtime import LlamaVocab  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
ANSWER = '{"name": "Ada Lovelace", "age": 36, "languages": ["English", "French"]}'


def llama_cpp_masks(runtime: LlamaVocab, tokens: list[int]) -> list[float]:
    vocab = llama_cpp.llama_model_get_vocab(runtime._model)
    gbnf = json_schema_to_gbnf(json.dumps(SCHEMA))
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
    n_vocab = runtime.n_vocab
    seconds = []
    for token in [*tokens, None]:
        data = (llama_cpp.llama_token_data * n_vocab)()
        for i in range(n_vocab):
            data[i].id, data[i].logit, data[i].p = i, 0.0, 0.0
        array = llama_cpp.llama_token_data_array(data, n_vocab, -1, False)
        began = time.perf_counter()
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
        seconds.append(time.perf_counter() - began)
        if token is not None:
            llama_cpp.llama_sampler_accept(sampler, token)
    llama_cpp.llama_sampler_free(sampler)
    return seconds


def llguidance_masks(
    runtime: LlamaVocab, tokenizer, tokens: list[int]
) -> tuple[list[float], float]:
    grammars = Grammars(lambda: tokenizer, runtime.n_vocab)
    began = time.perf_counter()
    constraint = grammars.constraint("json_schema", SCHEMA)
    compile_s = time.perf_counter() - began
    row = np.zeros((1, runtime.n_vocab), dtype=np.float32)
    seconds = []
    for token in [*tokens, None]:
        began = time.perf_counter()
        constraint.mask_rows(row, [])
        seconds.append(time.perf_counter() - began)
        if token is not None:
            constraint.commit([token])
    return seconds, compile_s


PROMPTS = (
    "Describe a person as JSON.",
    "Give me a JSON object for a new employee.",
    "Invent a character for a story, as JSON.",
)


def acceptance_rows(new_tokens: int = 64) -> list[tuple[str, str, int, int, bool]]:
    """Per prompt and way of drafting: (prompt, way, drafted, accepted, output alike)."""
    from drafter.client import VerifierClient
    from drafter.drafters.model import DraftModel
    from drafter.speculative.loop import SpeculativeLoop
    from scripts.harness.local import LocalVerifier
    from server.shared.defaults import DEFAULT_DRAFTER_MODEL
    from server.shared.protocol import Grammar, PrefillRequest

    grammar = Grammar(kind="json_schema", source=SCHEMA)
    rows = []
    env = {"VERIFIER_N_THREADS": "1", "VERIFIER_MAX_SESSIONS": "2"}
    with LocalVerifier(env) as verifier, VerifierClient(verifier.url) as client:
        model = DraftModel(DEFAULT_DRAFTER_MODEL, n_ctx=2048, n_threads=1)
        try:
            for text in PROMPTS:
                prompt = model.runtime.chat_prompt(text)
                outputs = []
                for way in ("under the grammar", "free"):
                    if way == "free":
                        model.follow = lambda *args: None  # type: ignore[method-assign]
                    loop = SpeculativeLoop(model, client, draft_n=4, n_ctx=1024)
                    for _ in loop.run(PrefillRequest(prompt=prompt, grammar=grammar), new_tokens):
                        pass
                    if way == "free":
                        del model.follow
                    stats = loop.result.stats
                    outputs.append(loop.result.tokens)
                    rows.append((text, way, stats.drafted, stats.accepted, False))
                alike = outputs[0] == outputs[1]
                rows[-2:] = [(*row[:4], alike) for row in rows[-2:]]
        finally:
            model.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=first_paragraph(__doc__), formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--acceptance",
        action="store_true",
        help="Also measure drafts accepted under a JSON schema, drafting under it or free.",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=DEFAULT_VERIFIER_MODEL,
        help="The GGUF whose vocabulary the masks cover.",
    )
    args = parser.parse_args()
    runtime = LlamaVocab(args.model, vocab_only=True)
    tokens = runtime.tokenize(ANSWER, add_special=False)
    began = time.perf_counter()
    tokenizer = runtime.grammar_tokenizer()
    tokenizer_s = time.perf_counter() - began
    guided, compile_s = llguidance_masks(runtime, tokenizer, tokens)
    native = llama_cpp_masks(runtime, tokens)
    print(f"{args.model.name}: {runtime.n_vocab} tokens; a JSON answer of {len(tokens)} tokens")
    print(
        f"llguidance: tokenizer built in {tokenizer_s:.2f} s (once), schema compiled in "
        f"{1000 * compile_s:.1f} ms (once a grammar)"
    )
    print("| engine | median ms a row | max ms a row |")
    print("|---|---:|---:|")
    for name, seconds in (("llguidance", guided), ("llama.cpp grammar sampler", native)):
        print(f"| {name} | {1000 * statistics.median(seconds):.3f} | {1000 * max(seconds):.3f} |")
    if args.acceptance:
        print("\n| prompt | drafts | drafted | accepted | acceptance | output alike |")
        print("|---|---|---:|---:|---:|---|")
        for text, way, drafted, accepted, alike in acceptance_rows():
            rate = accepted / drafted if drafted else 0.0
            print(f"| {text} | {way} | {drafted} | {accepted} | {rate:.2f} | {alike} |")


if __name__ == "__main__":
    main()
