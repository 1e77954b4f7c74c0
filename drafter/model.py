"""The local draft model: proposes the next k tokens with its own KV cache.

Shaped like HF transformers' CandidateGenerator: `get_candidates` drafts,
`update_candidate_strategy` learns from the verifier's answer. The KV cache follows the
committed tokens by longest common prefix, so after each round only the rejected drafts
are dropped and only new tokens (the target's token, at most one unevaluated draft) are
evaluated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from drafter.errors import DraftModelError
from server.protocol import SamplingParams, vocab_fingerprint
from server.runtime import BatchEntry, LlamaRuntime, RuntimeError_, supports_gpu_offload
from server.sampling import cap_support, probabilities, sample

SEQ_ID = 0
# Most tokens of q sent per draft position. Without top-k, q's support is the whole
# vocabulary; the drafter then samples from q cut to its 32 most likely tokens and sends
# exactly that cut q, which keeps rejection sampling lossless (server/sampling.py).
MAX_Q_SUPPORT = 32


@dataclass
class DraftPolicy:
    """How drafts are chosen: the argmax, or draws from q (what rejection sampling needs)."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    sample_drafts: bool = False
    seed: int | None = None
    max_support: int = MAX_Q_SUPPORT


class Draft(NamedTuple):
    tokens: list[int]
    probs: list[np.ndarray] | None  # q per position (dense), when drafts were sampled


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
        self.configure(DraftPolicy())

    def configure(self, policy: DraftPolicy) -> None:
        self.policy = policy
        self._rng = np.random.default_rng(policy.seed)

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
        return self.render_chat(messages)

    def render_chat(self, messages: Sequence[tuple[str, str]]) -> str:
        """(role, content) messages through the model's own chat template, ready for the
        assistant's turn."""
        return self.runtime.apply_chat_template(messages)

    def starts_with_bos(self, text: str) -> bool:
        bos_text = self.runtime.token_text(self.runtime.bos_id)
        return bool(bos_text) and text.encode().startswith(bos_text)

    # -- CandidateGenerator -----------------------------------------------------------

    def get_candidates(self, committed: Sequence[int], k: int) -> Draft:
        """Up to k draft tokens following `committed` (stops early at EOG)."""
        if k <= 0:
            return Draft([], [] if self.policy.sample_drafts else None)
        logits = self._sync(committed)
        draft_tokens: list[int] = []
        draft_probs: list[np.ndarray] = []
        while True:
            if self.policy.sample_drafts:
                q = cap_support(
                    probabilities(logits, self.policy.sampling), self.policy.max_support
                )
                token = sample(q, self._rng)
                draft_probs.append(q)
            else:
                token = int(np.argmax(logits))
            draft_tokens.append(token)
            if len(draft_tokens) == k or self.runtime.is_eog(token):
                return Draft(draft_tokens, draft_probs if self.policy.sample_drafts else None)
            logits = self._evaluate([token])

    def update_candidate_strategy(
        self, draft_tokens: Sequence[int], accepted_prefix_len: int
    ) -> None:
        """Fixed draft length for now; adaptive length will learn here."""

    def reset(self) -> None:
        """Forget the cache. A new, unrelated prompt should start here: this model's
        logits can depend on how its cache was filled (Q4_K kernels are not batch
        invariant), and a seeded run must not depend on the request before it."""
        self.runtime.clear_all()
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
