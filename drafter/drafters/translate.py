"""Drafting for a verifier whose tokenizer is not the draft model's: through text.

The verifier's ids stay the only ids on the wire and the verifier is unchanged; the
drafter holds the verifier's vocabulary (GET /vocab, cached by its hash) and translates
each round, as llama.cpp's common/speculative.cpp does when vocabularies are not
compatible (PR 12635):

- the committed verifier tokens, as text, tokenized by the draft model (its KV cache keeps
  what did not change, so only the new tail is evaluated);
- the draft, as text, tokenized by the verifier's vocabulary together with a short window
  of committed text, so that a token that merges across the boundary is seen; only the
  ids after the window's are sent, and none when the window's own ids come out otherwise.

Lossless as any draft is for greedy and `match`: the verifier alone decides. Rejection
sampling needs q over the verifier's vocabulary, which a draft model with another
tokenizer cannot give; the runner verifies with `match` instead and says so.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from drafter.drafters.model import DraftModel
from drafter.drafters.text import complete_text
from drafter.speculative.candidates import Draft, Drafter
from server.shared.prefix import common_prefix_len
from server.shared.protocol import PrefillRequest
from server.shared.runtime import LlamaVocab

# Committed verifier tokens re-tokenized with each draft: enough to cover a token that
# merges across the boundary (a word's end, a run of spaces).
WINDOW_TOKENS = 4


def vocab_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hetero-specdecode" / "vocab"


def cached_vocab_file(vocab_hash: str, fetch: Callable[[], bytes]) -> Path:
    """The verifier's vocabulary file, fetched once per vocabulary hash; kept only once it
    loads and is the vocabulary /info describes (`vocab_matches`)."""
    if not re.fullmatch(r"[0-9a-f]{64}", vocab_hash):  # a file name: never a path
        raise ValueError(f"the verifier's vocab_hash is not a sha256: {vocab_hash[:80]!r}")
    folder = vocab_cache_dir()
    path = folder / f"{vocab_hash}.gguf"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        data = fetch()
        if not data.startswith(b"GGUF"):
            raise ValueError("GET /vocab did not answer with a GGUF file")
        partial = path.with_suffix(f".{os.getpid()}.part")
        partial.write_bytes(data)
        try:
            vocab_matches(partial, vocab_hash).close()
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        partial.rename(path)  # whole and checked, or not at all
    return path


class TranslatingDrafter(Drafter):
    """A drafter over the verifier's ids, drafting with a model of another vocabulary
    (`target`: the verifier's vocabulary)."""

    warms = True

    def __init__(self, model: DraftModel, target: LlamaVocab):
        self.model = model
        self.target = target
        self._pieces: list[bytes] = []  # committed text, a piece per verifier token
        self._ids: list[int] = []
        self.boundary_misses = 0  # drafts dropped: their text merged into committed tokens
        self.translate_s = 0.0  # time spent translating, both ways (not drafting)

    def get_candidates(
        self, committed: Sequence[int], k: int, stop: Callable[[], bool] | None = None
    ) -> Draft:
        if k <= 0:
            return Draft([], None)
        began = time.perf_counter()
        own = self._within_context(self._own_tokens(committed), k)
        if not own:
            return Draft([], None)
        drafting = time.perf_counter()
        draft = self.model.get_candidates(own, k, stop)
        drafted = time.perf_counter()
        text = b"".join(self.model.token_bytes(t) for t in draft.tokens)
        ids = self._target_ids(committed, text)[:k]
        self.translate_s += (drafting - began) + (time.perf_counter() - drafted)
        return Draft(ids, None)

    def warm(self, prefill: PrefillRequest, stop: Callable[[], bool] | None = None) -> None:
        if prefill.prompt is not None:
            text = prefill.prompt.encode()
        else:
            text = b"".join(self._piece(t) for t in prefill.prompt_tokens or [])
        own = self._within_context(self._tokenize_own(text), 0)
        if own:
            self.model.warm(PrefillRequest(prompt_tokens=own, add_bos=False), stop)

    # -- committed tokens -> the draft model's tokens --------------------------------

    def _piece(self, token: int) -> bytes:
        # Special tokens spelled out (<|im_start|>): text the draft model can read.
        return self.target.token_bytes(token, special=True)

    def _committed_text(self, committed: Sequence[int]) -> bytes:
        # Pipelining drafts ahead of what is committed: keep the pieces both share.
        n = common_prefix_len(self._ids, committed)
        del self._ids[n:], self._pieces[n:]
        for token in committed[n:]:
            self._ids.append(token)
            self._pieces.append(self._piece(token))
        return b"".join(self._pieces)

    def _tokenize_own(self, text: bytes) -> list[int]:
        return self.model.runtime.tokenize(complete_text(text), add_special=True)

    def _own_tokens(self, committed: Sequence[int]) -> list[int]:
        return self._tokenize_own(self._committed_text(committed))

    def _within_context(self, own: list[int], k: int) -> list[int]:
        """The text's tail that fits the draft model's context with a draft (and one
        drafted ahead) after it: another tokenizer may need many more tokens for the same
        text than the verifier's context holds. The window slides, as llama.cpp's does."""
        room = self.model.runtime.n_ctx_per_seq - 2 * (k + 1)
        return own[-room:] if len(own) > room > 0 else own if room > 0 else []

    # -- draft text -> the verifier's ids --------------------------------------------

    def _target_ids(self, committed: Sequence[int], draft_text: bytes) -> list[int]:
        if not draft_text:
            return []
        window = list(committed[-WINDOW_TOKENS:])
        window_text = b"".join(self._piece(t) for t in window)
        ids = self.target.tokenize(complete_text(window_text + draft_text), add_special=False)
        if ids[: len(window)] != window:
            self.boundary_misses += 1
            return []
        return ids[len(window) :]


def vocab_matches(path: Path, vocab_hash: str) -> LlamaVocab:
    """The vocabulary file loaded, refused unless it is the one /info describes."""
    from server.shared.vocab import vocab_fingerprint

    target = LlamaVocab(path, vocab_only=True)
    if vocab_fingerprint(target.vocab_pieces()) != vocab_hash:
        target.close()
        raise ValueError(f"{path.name} is not the verifier's vocabulary (hash differs)")
    return target
