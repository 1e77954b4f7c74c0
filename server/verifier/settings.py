"""Every verifier setting, read once from `VERIFIER_*` environment variables."""

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from server.shared.defaults import DEFAULT_VERIFIER_MODEL, default_cache_dir
from server.shared.strict import unknown_variables
from server.verifier.decoding.copy_draft import COPY_NGRAM, RESYNC_SPAN

ENV_PREFIX = "VERIFIER_"


class VerifierSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_variables(cls, data: object) -> object:
        """A mistyped VERIFIER_* variable (VERIFIER_API_KEY for VERIFIER_API_KEYS) would
        leave its setting at the default, authentication off among them: refused."""
        unknown = unknown_variables(ENV_PREFIX, cls.model_fields)
        if unknown:
            raise ValueError("; ".join(unknown))
        return data

    model_path: Path = Field(DEFAULT_VERIFIER_MODEL, description="GGUF file of the target model")
    n_ctx: int = Field(
        0,
        ge=0,
        description="context length of each session, in tokens; 0 = the model's trained "
        "context, or less where kv_cache_mb cannot hold it for max_sessions sessions (fewer "
        "sessions, longer contexts)",
    )
    kv_cache_mb: int = Field(
        0,
        ge=0,
        description="memory for every session's KV cache, in MiB, when n_ctx is 0; 0 = half "
        "of what is free where the cache lives (the GPU after the weights, else the "
        "system's available memory less the model file, whose pages the passes read)",
    )
    n_gpu_layers: int = Field(
        0,
        ge=-1,
        description="layers offloaded to the GPU (-1 = all); asked of a build without GPU "
        "support, the start stops and names the rebuild",
    )
    n_threads: int = Field(
        0,
        ge=0,
        description="CPU threads for decoding (0 = the cores this process may use); a pass "
        "of one row uses one, unless a GPU runs every layer (docs/numerics.md)",
    )
    n_batch: int = Field(512, ge=16, description="largest number of tokens in one llama_decode")
    max_sessions: int = Field(8, ge=1, le=256, description="sessions held at once (KV sequences)")
    max_draft: int = Field(16, ge=0, le=256, description="longest draft accepted by /verify")
    session_ttl_s: float = Field(
        600.0, gt=0, description="idle sessions are ended after this many seconds"
    )
    prefix_ttl_s: float = Field(
        600.0, gt=0, description="cached prefixes are dropped after this many seconds"
    )
    key_share: int = Field(
        0,
        ge=0,
        description="sequences (sessions, cached prefixes, prompts) one API key holds before "
        "it gives up its own to get more when none is free; 0 = max_sessions divided among "
        "the keys holding any",
    )
    pack_sessions: bool = Field(
        True,
        description="keep sessions at neighbouring KV sequence ids, so that their rounds "
        "share one forward pass: a new session goes beside the others, moving a cached "
        "prefix out of the way if need be (a copy of one sequence's KV buffers)",
    )
    gather_rounds: bool = Field(
        True,
        description="hold queued rounds, at most a pass's fixed cost, for the sessions the "
        "last pass answered when they have been coming back within a pass, so that "
        "drafters share passes instead of taking turns in groups (holds take at most a "
        "fifth of the decoding time)",
    )
    key_present_s: float = Field(
        1.0,
        ge=0.0,
        description="seconds a key counts as present after its last round or prompt decoded: "
        "while another key is present, each client's draft is verified only as far as its "
        "session's advice (one token at least); 0 = only while another key's work is decoded",
    )
    verify_fast_path: bool = Field(
        True,
        description="answer POST /verify before Starlette's routing and FastAPI's request "
        "handling (same checks, errors and metrics; less time a round)",
    )
    pin_shapes: Literal["auto", "on", "off"] = Field(
        "auto",
        description="pinned pass shapes, every pass every session at pin_width rows, for "
        "builds whose kernels change with the row count (GPUs): auto = when the startup "
        "probe finds free shapes inexact and pinned ones exact",
    )
    pin_width: int = Field(
        0, ge=0, le=1024, description="rows per session in a pinned pass; 0 = max_draft + 1"
    )
    pass_cost_rows: float = Field(
        0.0,
        ge=0.0,
        description="what one forward pass costs, in rows: the planner pads and fills up to "
        "this many rows to save a pass; 0 = measured by the startup probe",
    )
    probe_cache_dir: str = Field(
        default_factory=lambda: default_cache_dir("probe"),
        description="where the startup probe keeps its verdicts: a start on the same build, "
        "model file, shapes, threads, device and probe code takes them instead of probing "
        "again (its passes are timed at every start); empty = probe at every start",
    )
    prefix_cache: bool = Field(
        True,
        description="keep an ended session's KV sequence as a prefix for the same API key's "
        "next prompt (only on a batch-invariant build: reuse must not change output)",
    )
    prompt_chunk: int = Field(
        0,
        ge=0,
        description="a prompt's tokens per decode; 0 = n_batch, or with prefix_cache on, the "
        "longest length the startup probe finds exact (short chunks: slower cold prompts, "
        "prompt reuse on where long ones would change the numbers)",
    )
    prompt_tile_rows: int = Field(
        64,
        ge=0,
        description="rows of one sequence from which the build's kernels take their tiled "
        "path (the CPU build's flash attention: 64): where prompt chunks are not exact "
        "however cut, a prompt's stretches of at least this many tokens go in passes of at "
        "least this many rows and the rest in passes of fewer, if the startup probe finds "
        "that exact (docs/numerics.md); 0 = never",
    )
    chunk_copy_ngram: int = Field(
        COPY_NGRAM,
        ge=0,
        le=256,
        description="where a session's last this many tokens occurred earlier in its own text, "
        "a step of its chunks (a round asking for several of the verifier's own tokens) drafts "
        "what followed them there, as llama.cpp's ngram-simple does, when the verifier's cost "
        "of a pass says it pays (server/verifier/decoding/copy_draft.py); 0 = never",
    )
    chunk_copy_resync: int = Field(
        RESYNC_SPAN,
        ge=0,
        le=1024,
        description="for this many tokens after a chunk's copy broke off (an edit in a repeated "
        "text: a name renamed), a step looks for its last two tokens just past where the text left "
        "the source, and copies on from there (server/verifier/decoding/copy_draft.py); 0 = never",
    )
    lookup_sizing: bool = Field(
        True,
        description="a client's lookup draft that carries its estimated acceptance "
        "(draft_accept) is verified as far as the cost of a pass says it pays, and where no "
        "part pays, the round is the chunk it asked for (server/verifier/decoding/copy_draft.py); "
        "false: /info says lookup_sizing false, and such a draft is verified whole",
    )
    prompt_pad: Literal["auto", "always", "off"] = Field(
        "auto",
        description="with tiled prompts, a stretch shorter than a tile (a chat's next message, "
        "a tool's result) goes tiled in one pass padded to prompt_tile_rows rows, the padding "
        "removed after, if the startup probe finds that exact: auto = where that costs less "
        "than its rows below the tile (the longer the context, the shorter the stretch), "
        "always, or off (docs/numerics.md)",
    )
    prompt_replies_below_tile: bool = Field(
        True,
        description="with tiled prompts, the model's earlier replies in a chat prompt (after "
        "the reply opener its chat template writes, up to an end-of-turn token) go below the "
        "tile, as the rounds that generated them did, so that a next turn sent at once keeps "
        "their cells (docs/numerics.md)",
    )
    idle_retile_after_s: float = Field(
        0.25,
        ge=0.0,
        description="seconds without a request after which the verifier evaluates cached "
        "prefixes' generated tokens again as a next prompt would, a piece at a time, so that "
        "a conversation's next turn keeps them (docs/numerics.md); 0 = never",
    )
    prefix_cache_min_tokens: int = Field(
        16, ge=1, description="shortest common prefix worth reusing, in tokens"
    )
    max_queue: int = Field(
        64, ge=1, description="requests waiting at most; beyond it new work gets 503"
    )
    max_prompt_chars: int = Field(
        0,
        ge=0,
        description="longest prompt text accepted, in characters (longer: 413 before it is "
        "tokenized); 0 = n_ctx times the vocabulary's longest token, the most that can fit",
    )
    grammar_row_ms: float = Field(
        200.0,
        ge=0,
        description="longest a grammar may take for one token's mask; a session's grammar "
        "that takes longer ends its generation with 400 (0 = no limit)",
    )
    grammar_compile_s: float = Field(
        10.0,
        ge=0,
        description="longest a grammar may take to compile (with its first mask); longer is "
        "refused with 400, and so is the same grammar again (0 = no limit)",
    )
    grammar_unproven_tokens: int = Field(
        4096,
        ge=0,
        description="most tokens a session may generate under a grammar the verifier cannot "
        "prove can end (a way to its end through a part the check does not read): a round's "
        "draft is verified as far as fits, a round at it is refused with 400 "
        "grammar_token_limit, and the prefill names the bound (0 = no bound but the context)",
    )
    grammar_max_mb: int = Field(
        64, ge=0, description="most memory one compiled grammar may take, in MB (0 = no limit)"
    )
    grammar_cache_mb: int = Field(
        256,
        ge=0,
        description="memory an API key's compiled grammars may hold for its next sessions, "
        "in MB; past it the key's own oldest go (0 = no limit)",
    )
    max_generate_tokens: int = Field(
        2048, ge=1, description="upper bound on max_tokens for /generate"
    )
    api_keys: str = Field(
        "", description="comma-separated API keys; empty (and no key file) = no auth"
    )
    api_key_file: Path | None = Field(None, description="file with one API key per line")
    admin_api_keys: str = Field(
        "",
        description="comma-separated keys that may also read /metrics; with any key set "
        "(API or admin), /metrics needs one of these (it describes every key's traffic)",
    )
    max_body_bytes: int = Field(
        4 << 20, ge=1024, description="largest request body; larger gets 413"
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="a request body must arrive within this; slower gets 408"
    )
    # Batched and one-at-a-time decoding agree bit for bit only with flash attention on
    # (docs/numerics.md); turning it off breaks greedy losslessness.
    flash_attn: bool = Field(True, description="use flash attention (needed for exactness)")
    listen_after_load: bool = Field(
        False,
        description="load the model before accepting connections (a failed load exits): "
        "behind a balancer that checks replicas only by their connections (open-source "
        "nginx), a loading replica is then passed over instead of answering 503",
    )
    wait_for_model: bool = Field(
        False,
        description="keep running (GET /health: 503) when the model file is missing or "
        "does not load, instead of exiting with an error",
    )
    verbose: bool = Field(False, description="print llama.cpp's own log to stderr")

    @field_validator("n_ctx")
    @classmethod
    def _a_context_or_auto(cls, n_ctx: int) -> int:
        if 0 < n_ctx < 16:
            raise ValueError("a session's context is at least 16 tokens (0: sized to the model)")
        return n_ctx


@lru_cache
def get_settings() -> VerifierSettings:
    return VerifierSettings()
