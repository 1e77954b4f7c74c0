"""Everything the CLI shows goes through one of these renderers."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from rich.text import Text

from drafter.drafters.text import TextDecoder
from drafter.speculative.loop import RoundEvent, SpeculativeResult
from server.shared.machine import usable_cores

ACCEPTED_STYLE = "green"
TARGET_STYLE = "bold yellow"
# A load average past this many times the cores: more work than the cores could run, the
# demo's own verifier and drafter (half the cores each) not enough to reach it.
BUSY_LOAD = 1.5


@dataclass
class BaselineResult:
    tokens: list[int]
    total_time_s: float
    server_tokens_per_s: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.total_time_s if self.total_time_s > 0 else 0.0


def speedup(result: SpeculativeResult, baseline: BaselineResult) -> float:
    base = baseline.tokens_per_s
    return result.stats.tokens_per_s / base if base > 0 else 0.0


def busy_note(load: float | None = None, cores: int | None = None) -> str:
    """A note for a ratio measured while this machine ran more than its cores could (a
    verifier on it, other work): the two runs come one after the other, and the load
    between them moves the ratio more than anything measured."""
    try:
        load = os.getloadavg()[0] if load is None else load
    except OSError:
        return ""
    cores = usable_cores() if cores is None else cores
    if load <= BUSY_LOAD * cores:
        return ""
    return f" (noisy: load {load:.1f} on {cores} cores while it ran)"


VOCAB_NOTES = {
    "same": "same as the verifier's",
    "compatible": "compatible with the verifier's (ids sent as they are)",
    "translated": "another tokenizer (drafts translated through text)",
}


def lossless_note(result: SpeculativeResult) -> str:
    """Why the output may not be exactly the verifier's own, if it may not be."""
    if result.lossless:
        return ""
    if result.strategy == "greedy":
        # The verifier's startup probe found logits that change with the batch shape.
        return " (NOT exact: the verifier is not batch-invariant, see its /info)"
    return " (LOSSY: not the verifier's distribution)"


class TextRenderer:
    """Streams the answer; on a terminal, accepted drafts and target tokens differ in colour."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(highlight=False, soft_wrap=True)
        self.err = Console(stderr=True, highlight=False)
        self._decoder: TextDecoder | None = None
        self._mid_text = False  # the answer is being streamed and its line is open

    def status(self, message: str) -> None:
        self._end_text()
        self.err.print(f"[dim]{message}[/dim]")

    def start(self, token_bytes: Callable[[int], bytes]) -> None:
        self._decoder = TextDecoder(token_bytes)

    @property
    def _started(self) -> TextDecoder:
        assert self._decoder is not None, "start() comes first"
        return self._decoder

    def _end_text(self) -> None:
        if self._mid_text:
            self.console.print(self._started.flush())
            self._mid_text = False

    def round(self, event: RoundEvent) -> None:
        text = Text()
        text.append(self._started.feed(event.tokens[: event.accepted_prefix_len]), ACCEPTED_STYLE)
        text.append(self._started.feed(event.tokens[event.accepted_prefix_len :]), TARGET_STYLE)
        self.console.print(text, end="")
        self._mid_text = True

    def finish(self, result: SpeculativeResult, baseline: BaselineResult | None) -> None:
        self._end_text()
        self.console.print()
        stats = result.stats
        table = Table(title="speculative decoding", show_header=False, title_justify="left")
        table.add_column("stat")
        table.add_column("value", justify="right")
        rows = [
            ("prompt tokens", f"{stats.prompt_tokens}"),
            ("generated tokens", f"{stats.generated_tokens} ({result.finish_reason})"),
            ("rounds", f"{stats.rounds}"),
            (
                "rounds without a draft",
                f"{stats.rounds_without_draft} ({stats.tokens_without_draft} tokens: the "
                "verifier's own, where drafting could not pay)",
            ),
            ("mean draft length", f"{stats.mean_draft_len:.2f}"),
            ("drafted", f"{stats.drafted}"),
            ("accepted", f"{stats.accepted}"),
            ("acceptance rate", f"{stats.acceptance_rate:.1%}"),
            ("tokens per round", f"{stats.tokens_per_round:.2f}"),
            ("total time", f"{stats.total_time_s:.3f} s"),
            ("tokens/s", f"{stats.tokens_per_s:.1f}"),
            ("bytes sent", f"{stats.bytes_sent:,}"),
            ("bytes received", f"{stats.bytes_received:,}"),
        ]
        rows.insert(0, ("strategy", f"{result.strategy}{lossless_note(result)}"))
        rows.insert(1, ("vocabulary", VOCAB_NOTES.get(result.vocab, result.vocab)))
        rows += [
            (
                "bytes per round",
                f"{stats.bytes_sent_per_round:,.0f} sent, "
                f"{stats.bytes_received_per_round:,.0f} received",
            ),
            (
                "time per round",
                f"{stats.draft_time_s * 1000 / max(stats.rounds, 1):.1f} ms drafting, "
                f"{stats.verifier_time_s * 1000 / max(stats.rounds, 1):.1f} ms verifier, "
                f"{stats.protocol_overhead_ms:.1f} ms protocol and network",
            ),
        ]
        if stats.reused_drafts:
            rows.append(("drafted while verifying", f"{stats.reused_drafts} of {stats.drafted}"))
        if stats.lookup_rounds:  # a lookup beside the model: acceptance per kind of draft
            model_drafted = stats.drafted - stats.lookup_drafted
            rows.append(
                (
                    "accepted by kind",
                    f"lookup {stats.lookup_accepted} of {stats.lookup_drafted} "
                    f"({stats.lookup_rounds} rounds), model "
                    f"{stats.accepted - stats.lookup_accepted} of {model_drafted}",
                )
            )
        if baseline is not None:
            rows += [
                ("baseline tokens/s", f"{baseline.tokens_per_s:.1f} (verifier alone, /generate)"),
                ("speedup (measured)", f"{speedup(result, baseline):.2f}x{busy_note()}"),
            ]
            if result.strategy == "greedy":
                same = "yes" if baseline.tokens == result.tokens else "NO"
                if not result.lossless:
                    same += " (not guaranteed: the verifier is not batch-invariant)"
                rows.append(("same tokens as baseline", same))
        for row in rows:
            table.add_row(*row)
        self.console.print(table)


class JsonRenderer:
    """One JSON object on stdout at the end; progress, if any, on stderr."""

    def __init__(self) -> None:
        self._decoder: TextDecoder | None = None
        self._text: list[str] = []

    def status(self, message: str) -> None:
        del message

    def start(self, token_bytes: Callable[[int], bytes]) -> None:
        self._decoder = TextDecoder(token_bytes)

    @property
    def _started(self) -> TextDecoder:
        assert self._decoder is not None, "start() comes first"
        return self._decoder

    def round(self, event: RoundEvent) -> None:
        self._text.append(self._started.feed(event.tokens))

    def finish(self, result: SpeculativeResult, baseline: BaselineResult | None) -> None:
        self._text.append(self._started.flush())
        out: dict[str, object] = {
            "prompt_ids": result.prompt_ids,
            "tokens": result.tokens,
            "text": "".join(self._text),
            "finish_reason": result.finish_reason,
            "strategy": result.strategy,
            "lossless": result.lossless,
            "vocab": result.vocab,
            "stats": result.stats.as_dict(),
        }
        if baseline is not None:
            out["baseline"] = {
                "tokens": baseline.tokens,
                "tokens_per_s": round(baseline.tokens_per_s, 4),
                "server_tokens_per_s": baseline.server_tokens_per_s,
                "total_time_s": round(baseline.total_time_s, 4),
                "identical": baseline.tokens == result.tokens,
            }
            out["speedup"] = round(speedup(result, baseline), 4)
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
