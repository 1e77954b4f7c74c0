"""The local draft model: proposes the next k tokens with its own KV cache.

Shaped like HF transformers' CandidateGenerator: `get_candidates` drafts,
`update_candidate_strategy` learns from the verifier's answer. The KV cache follows the
committed tokens by longest common prefix, so after each round only the rejected drafts
are dropped and only new tokens (the target's token, at most one unevaluated draft) are
evaluated.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from drafter.errors import DraftModelError
from server.protocol import vocab_fingerprint
from server.runtime import BatchEntry, LlamaRuntime, RuntimeError_, supports_gpu_offload

SEQ_ID = 0


def default_gpu_layers() -> int:
    """All layers on the GPU (Metal, CUDA) when this llama.cpp build has one, else none."""
    return -1 if supports_gpu_offload() else 0


class DraftModel:
    def __init__(
        self,
        model_path: str | Path,
        *,
        n_ctx: int,
        n_gpu_layers: int | None = None,
        n_threads: int = 0,
        verbose: bool = False,
    ):
        try:
            self.runtime = LlamaRuntime(
                model_path,
                n_ctx_per_seq=n_ctx,
                n_seq_max=1,
                n_threads=n_threads,
                n_gpu_layers=default_gpu_layers() if n_gpu_layers is None else n_gpu_layers,
                verbose=verbose,
            )
        except (FileNotFoundError, RuntimeError_) as exc:
            raise DraftModelError(f"cannot load the draft model: {exc}") from exc
        self.model_path = Path(model_path)
        self.name = self.runtime.metadata("general.name") or self.model_path.stem
        self._cached: list[int] = []  # tokens whose KV entries are in the cache
        self._last_logits: np.ndarray | None = None
        self.decoded_tokens = 0

    @property
    def vocab_hash(self) -> str:
        return vocab_fingerprint(self.runtime.vocab_pieces())

    @property
    def n_vocab(self) -> int:
        return self.runtime.n_vocab

    def token_bytes(self, token: int) -> bytes:
        return self.runtime.token_bytes(token)

    def chat_prompt(self, user: str, system: str | None = None) -> str:
        messages = [("system", system)] if system else []
        messages.append(("user", user))
        return self.runtime.apply_chat_template(messages)

    def starts_with_bos(self, text: str) -> bool:
        bos_text = self.runtime.token_text(self.runtime.bos_id)
        return bool(bos_text) and text.encode().startswith(bos_text)

    # -- CandidateGenerator -----------------------------------------------------------

    def get_candidates(self, committed: Sequence[int], k: int) -> list[int]:
        """Greedy draft of up to k tokens following `committed` (stops early at EOG)."""
        if k <= 0:
            return []
        logits = self._sync(committed)
        draft_tokens: list[int] = []
        while True:
            token = int(np.argmax(logits))
            draft_tokens.append(token)
            if len(draft_tokens) == k or self.runtime.is_eog(token):
                return draft_tokens
            logits = self._evaluate([token])

    def update_candidate_strategy(
        self, draft_tokens: Sequence[int], accepted_prefix_len: int
    ) -> None:
        """Fixed draft length for now; adaptive length will learn here."""

    def reset(self) -> None:
        self.runtime.clear(SEQ_ID)
        self._cached = []
        self._last_logits = None

    def close(self) -> None:
        self.runtime.close()

    # -- KV cache ---------------------------------------------------------------------

    def _sync(self, committed: Sequence[int]) -> np.ndarray:
        """Make the cache hold exactly `committed`; return the logits after its last token."""
        common = 0
        limit = min(len(self._cached), len(committed))
        while common < limit and self._cached[common] == committed[common]:
            common += 1
        if common == len(committed) == len(self._cached) and self._last_logits is not None:
            return self._last_logits
        if common == len(committed):
            common -= 1  # the last token's logits are needed: evaluate it again
        self.runtime.remove(SEQ_ID, common)
        del self._cached[common:]
        return self._evaluate(committed[common:])

    def _evaluate(self, tokens: Sequence[int]) -> np.ndarray:
        start = len(self._cached)
        if len(tokens) == 1:
            entry = BatchEntry(token=tokens[0], pos=start, seq_id=SEQ_ID, want_logits=True)
            logits = self.runtime.decode([entry])[0]
        else:
            logits = self.runtime.decode_sequence(SEQ_ID, tokens, start, logits="last")[0]
        self._cached.extend(tokens)
        self.decoded_tokens += len(tokens)
        self._last_logits = logits
        return logits
