"""How the engine cuts prompts (prompt_cuts.py): the probe's verdict, and where this
model's chat prompts hold its replies, read once from its chat template and vocabulary."""

from __future__ import annotations

from server.shared.runtime import LlamaRuntime
from server.verifier.kv.prompt_cuts import PromptCuts, Replies
from server.verifier.probe.invariance import InvarianceReport
from server.verifier.settings import VerifierSettings


def model_replies(runtime: LlamaRuntime, on: bool = True) -> Replies:
    """The reply opener its template writes and its end-of-turn tokens; no replies where
    it has neither, or where `on` is False (every prompt one stretch)."""
    if not on:
        return Replies()
    opener = tuple(runtime.reply_opener())
    ends = frozenset(t for t in range(runtime.n_vocab) if runtime.is_eog(t))
    return Replies(opener, ends) if opener and ends else Replies()


def engine_cuts(
    runtime: LlamaRuntime, report: InvarianceReport, settings: VerifierSettings
) -> PromptCuts:
    """The probe's verdict, the settings' replies and padding (where the probe found padded
    passes exact)."""
    replies = model_replies(runtime, settings.prompt_replies_below_tile)
    pad = settings.prompt_pad if report.prompt_padded else "off"
    return PromptCuts(report.prompt_chunk, report.prompt_tile_rows, replies, pad)
