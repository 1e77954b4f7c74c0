"""What a row costs where the verifier runs: llama.cpp's passes timed through the
verifier's own runtime (no server, no scheduling). scripts/gpu/measure.py runs it as a
process of its own, so that a crash in llama.cpp costs this part only and leaves its
Python stack (`-X faulthandler`) in the report:

    python3 -X faulthandler scripts/gpu/physics.py --model M --contexts 100,2000 \
        --rows 1,2,4 --sessions 1,2,4 --repeats 3      # prints one JSON object
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from server.shared.runtime import BatchEntry, LlamaRuntime

ROUND_ROWS = 5  # a round of 4 drafts and the pending token


def _runtime(model: Path, gpu_layers: int, n_seq: int, n_ctx: int) -> LlamaRuntime:
    n_ctx = -(-n_ctx // 256) * 256  # llama.cpp's KV cache grows in steps of 256 cells
    return LlamaRuntime(
        model, n_ctx_per_seq=n_ctx, n_seq_max=n_seq, n_batch=512, n_gpu_layers=gpu_layers
    )


def _fill(runtime: LlamaRuntime, seq_id: int, n_tokens: int, rng: np.random.Generator) -> None:
    tokens = rng.integers(10, runtime.n_vocab - 10, size=n_tokens).tolist()
    for start in range(0, n_tokens, runtime.n_batch):
        chunk = tokens[start : start + runtime.n_batch]
        runtime.decode([
            BatchEntry(t, start + i, seq_id, start + i == n_tokens - 1) for i, t in enumerate(chunk)
        ])  # fmt: skip


def _timed(runtime: LlamaRuntime, entries: list[BatchEntry], repeats: int) -> float:
    """Median ms of a pass of `entries` (every row's logits read, as a round's are), its
    cells removed after each."""
    times = []
    for attempt in range(repeats + 1):
        began = time.perf_counter()
        runtime.decode(entries)
        spent = time.perf_counter() - began
        for seq_id in {e.seq_id for e in entries}:
            runtime.remove(seq_id, min(e.pos for e in entries if e.seq_id == seq_id))
        if attempt:  # the first is a warm-up
            times.append(spent * 1000.0)
    return statistics.median(times)


def round_times(
    model: Path, gpu_layers: int, contexts: list[int], row_counts: list[int], repeats: int
) -> dict[int, dict[int, float]]:
    """{context: {rows: ms}}: one session's round of `rows` rows after `context` tokens."""
    rng = np.random.default_rng(0)
    runtime = _runtime(model, gpu_layers, 1, max(contexts) + max(row_counts) + 16)
    try:
        out: dict[int, dict[int, float]] = {}
        for context in contexts:
            runtime.clear(0)
            _fill(runtime, 0, context, rng)
            out[context] = {
                rows: _timed(
                    runtime, [BatchEntry(7 + i, context + i, 0, True) for i in range(rows)], repeats
                )
                for rows in row_counts
            }
        return out
    finally:
        runtime.close()


def pass_times(
    model: Path, gpu_layers: int, context: int, sessions: list[int], repeats: int
) -> dict[int, float]:
    """{sessions: ms}: one pass of that many sessions' 5-row rounds after `context` tokens."""
    rng = np.random.default_rng(1)
    runtime = _runtime(model, gpu_layers, max(sessions), context + ROUND_ROWS + 16)
    try:
        _fill(runtime, 0, context, rng)
        for seq_id in range(1, max(sessions)):
            runtime.copy(0, seq_id)
        return {
            n: _timed(
                runtime,
                [
                    BatchEntry(7 + i, context + i, s, True)
                    for s in range(n)
                    for i in range(ROUND_ROWS)
                ],
                repeats,
            )
            for n in sessions
        }
    finally:
        runtime.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--gpu-layers", type=int, default=-1)
    parser.add_argument("--contexts", required=True)
    parser.add_argument("--rows", required=True)
    parser.add_argument("--sessions", required=True)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    contexts, rows, sessions = (
        [int(n) for n in s.split(",")] for s in (args.contexts, args.rows, args.sessions)
    )
    rounds = round_times(args.model, args.gpu_layers, contexts, rows, args.repeats)
    print(json.dumps({"rounds": rounds}), flush=True)  # a later crash keeps these
    passes = pass_times(args.model, args.gpu_layers, contexts[0], sessions, args.repeats)
    print(json.dumps({"passes": passes}), flush=True)


if __name__ == "__main__":
    main()
