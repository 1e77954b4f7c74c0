"""Where a row's logits move with the pass it is computed in, on the device the verifier
runs on: the startup probe (server/verifier/probe/invariance.py) run on one verifier runtime
with shapes free and pinned, each with its checks at a short context only (every pass
attends over the same span of cells) and with those after a long one (a long round, and
rounds beside a long sequence: the span grows to the longest sequence's). Where the
verifier's own probe says `batch_invariant: false`, these rows tell which shapes differ.
scripts/gpu/measure.py runs it as a process of its own (a crash costs this part only):

    python3 -X faulthandler scripts/gpu/shapes.py --model M --sessions 8   # JSON lines
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from server.verifier.decoding.decoder import PassDecoder
from server.verifier.edge.app import build_runtime
from server.verifier.probe import invariance
from server.verifier.settings import VerifierSettings

KEPT = ("batch_invariant", "max_abs_diff", "argmax_agrees", "pinned_width", "pinned_logits")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--gpu-layers", type=int, default=-1)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--n-ctx", type=int, default=2048)
    args = parser.parse_args()
    settings = VerifierSettings(
        model_path=args.model,
        n_gpu_layers=args.gpu_layers,
        max_sessions=args.sessions,
        n_ctx=args.n_ctx,
    )
    runtime = build_runtime(settings)
    try:
        arguments = invariance.probe_arguments(PassDecoder(runtime), settings, reuse=False)
        for pin in ("off", "on"):
            for long_context in (0, arguments["long_context"]):
                row: dict[str, object] = {"pin": pin, "long_context": long_context}
                began = time.perf_counter()
                try:
                    report = invariance.probe(
                        **{**arguments, "pin": pin, "long_context": long_context}
                    )
                    row.update((k, v) for k, v in asdict(report).items() if k in KEPT)
                except Exception as exc:  # the other configurations' rows still count
                    row["error"] = f"{type(exc).__name__}: {exc}"
                print(json.dumps({**row, "s": round(time.perf_counter() - began, 2)}), flush=True)
    finally:
        runtime.close()


if __name__ == "__main__":
    main()
