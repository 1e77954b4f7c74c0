"""GET /info's answer: what a drafter checks before its first round (docs/protocol.md)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from server.shared.protocol import LOSSLESS, PROTOCOL_VERSION, ResponseModel
from server.shared.vocab import VocabFacts

# The vocabulary's facts (server/shared/vocab.py) and the flat /info fields that carry
# them: one mapping, both ways, so that the wire stays as older clients read it.
VOCAB_FIELDS = {
    "type": "vocab_type",
    "n_vocab": "n_vocab",
    "bos_id": "bos_id",
    "eos_id": "eos_id",
    "add_bos": "add_bos",
    "add_eos": "add_eos",
    "hash": "vocab_hash",
    "text_hashes": "vocab_text_hashes",
}


class InfoResponse(ResponseModel):
    protocol_version: int = PROTOCOL_VERSION
    model: str
    model_path: str
    quantization: str
    n_vocab: int
    n_ctx: int
    bos_id: int
    eos_id: int
    add_bos: bool
    vocab_hash: str
    # What a drafter with another vocabulary needs to judge it as llama.cpp does
    # (server/shared/vocab.py); an older verifier leaves them out, and only "same" passes.
    vocab_type: str = ""
    add_eos: bool = False
    max_draft: int
    max_chunk_tokens: int = Field(
        1, description="the most tokens a round without a draft may ask for (chunk_tokens)"
    )
    max_sessions: int
    # Where the model computes and what sized the context: an older verifier leaves them out.
    n_ctx_train: int = Field(0, description="the context the model was trained for")
    context_source: str = Field(
        "",
        description="what set n_ctx: asked (VERIFIER_N_CTX), trained (the model's trained "
        "context) or budget (VERIFIER_KV_CACHE_MB over max_sessions: fewer sessions, more "
        "context)",
    )
    backend: str = Field("", description="where the layers run: CPU, CUDA, Metal, ...")
    device: str = Field("", description="the backend's device: a GPU's name, or the CPU's")
    gpu_layers: int = Field(0, description="layers offloaded to the GPU (the output layer is one)")
    n_layer: int = Field(0, description="the model's layers, the output layer not counted")
    flash_attn: bool
    batch_invariant: bool = Field(
        True,
        description="whether a row's logits were bit-identical however it was batched, in "
        "the startup probe on this build and device; greedy is token for token only if so",
    )
    batch_max_diff: float = Field(
        0.0, description="the probe's largest logit difference between batch shapes"
    )
    pinned_width: int = Field(
        0,
        description="> 0: every pass is every session this many rows wide (shapes pinned "
        "because this build's kernels change with the row count)",
    )
    pinned_logits: bool = Field(False, description="pinned passes compute every row's logits")
    max_pass_rows: int = Field(0, description="the most rows one pass of rounds has")
    pass_cost_rows: float = Field(
        0.0, description="what one forward pass costs here, in rows (the pass planner's trade)"
    )
    prefill_chunk_invariant: bool = Field(
        True,
        description="whether the probe's prompt gave the same next-token logits evaluated in "
        "one chunk and in two; prompt reuse is exact, so on, only if so",
    )
    prefill_chunk_max_diff: float = Field(0.0, description="the chunking check's difference")
    prompt_chunk: int = Field(0, description="a prompt's tokens per decode on this server")
    prompt_tile_rows: int = Field(0, description="> 0: prompts tiled, >= this many rows a pass")
    prompt_pad: str = Field(
        "off", description="shorter stretches padded to a tiled pass: auto, always or off"
    )
    prefix_cache: bool = Field(False, description="ended sessions' prompts kept and reused")
    lookup_drafts: bool = Field(False, description="rounds may say draft_kind 'lookup'")
    cache_scopes: bool = Field(
        False, description="a prefill may carry cache_scope (prefix reuse within it only)"
    )
    lookup_sizing: bool = Field(
        False, description="a lookup's draft may carry draft_accept (the verifier sizes it)"
    )
    chunk_copy_ngram: int = Field(
        0,
        description="a chunk's step copies where the session's last this many tokens "
        "occurred earlier in its text (0: never)",
    )
    strategies: dict[str, bool] = Field(
        default_factory=lambda: {str(s.value): ok for s, ok in LOSSLESS.items()},
        description="verification strategies, each mapped to whether it is lossless here",
    )
    # Last: 129 hashes, read by drafters, skimmed past by people.
    vocab_text_hashes: dict[int, str] = Field(
        default_factory=dict,
        description="hash of the token texts of ids 5 to end-1, for every end within 128 "
        "of n_vocab: a drafter compares the range both vocabularies have",
    )

    @staticmethod
    def vocabulary_fields(facts: VocabFacts) -> dict[str, Any]:
        """/info's fields for a vocabulary's facts (the verifier's own, at start)."""
        return {field: getattr(facts, fact) for fact, field in VOCAB_FIELDS.items()}

    def vocabulary(self) -> VocabFacts:
        """The verifier's vocabulary as a drafter compares it (server/shared/vocab.py). An
        older verifier leaves vocab_type out ("") and add_eos (False): only "same" passes."""
        return VocabFacts(**{fact: getattr(self, field) for fact, field in VOCAB_FIELDS.items()})

    def context_hint(self) -> str:
        """Where more context is to be had, for a prompt that does not fit."""
        if self.context_source == "trained":
            return "all the model was trained for: a model trained on longer texts"
        if self.context_source == "budget":
            return (
                "what its memory holds for VERIFIER_MAX_SESSIONS sessions: fewer sessions, a "
                "larger VERIFIER_KV_CACHE_MB, or VERIFIER_N_CTX"
            )
        return "its VERIFIER_N_CTX"
