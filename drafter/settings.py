"""Every drafter setting, once: its default, its meaning, its `DRAFTER_*` variable.

The CLI's flags are made from these fields (drafter/cli.py), so a default or a help text
lives here only. Precedence, highest first: a flag on the command line, a `DRAFTER_*`
environment variable, the default below.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from drafter.request_options import RequestOptions
from server.shared.defaults import DEFAULT_DRAFTER_MODEL
from server.shared.protocol import MAX_DRAFT_SCHEMA, SamplingParams, Strategy
from server.shared.strict import unknown_variables

ENV_PREFIX = "DRAFTER_"


class DrafterKind(StrEnum):
    model = "model"
    ngram = "ngram"
    model_ngram = "model+ngram"
    suffix = "suffix"
    model_suffix = "model+suffix"
    model_history = "model+history"


# Who drafts by looking text up, with no model of its own (drafter/drafters/ngram.py, suffix.py).
LOOKUPS = frozenset({DrafterKind.ngram, DrafterKind.suffix})
# A lookup with the draft model behind it.
MODEL_WITH_LOOKUP = frozenset(
    {DrafterKind.model_ngram, DrafterKind.model_suffix, DrafterKind.model_history}
)
# Who drafts from the user's history (drafter/drafters/suffix.py, history_lookup.py).
WITH_HISTORY = frozenset({DrafterKind.suffix, DrafterKind.model_suffix, DrafterKind.model_history})


class HistoryScope(StrEnum):
    """Whose earlier requests a `serve` request may be drafted from (drafter/principals.py)."""

    auto = "auto"
    user = "user"
    key = "key"
    none = "none"


class OutputFormat(StrEnum):
    text = "text"
    json = "json"


DraftN = int | Literal["auto"]


def parse_draft_n(value: object) -> DraftN:
    """'auto' or a number of tokens in [0, MAX_DRAFT_SCHEMA]; ValueError otherwise."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    k = int(value)  # type: ignore[call-overload]
    if not 0 <= k <= MAX_DRAFT_SCHEMA:
        raise ValueError(f"a number of tokens in [0, {MAX_DRAFT_SCHEMA}] or 'auto'")
    return k


class DrafterSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_variables(cls, data: object) -> object:
        """A mistyped DRAFTER_* variable would leave its setting at the default: refused."""
        unknown = unknown_variables(ENV_PREFIX, cls.model_fields)
        if unknown:
            raise ValueError("; ".join(unknown))
        return data

    # -- the verifier ------------------------------------------------------------------
    server: str = Field("http://127.0.0.1:8000", description="The verifier's base URL.")
    api_key: str | None = Field(
        None, description="The verifier's API key (sent as Authorization: Bearer)."
    )
    ca_cert: Path | None = Field(
        None, description="A CA certificate to trust for an https:// verifier."
    )
    timeout: float = Field(60.0, gt=0, description="Seconds to wait for each request.")
    retries: int = Field(
        6,
        ge=0,
        description="Retries, with backoff, of a request whose connection was lost or that "
        "got 502, 503 or 504 from a verifier that was reachable before.",
    )
    restart_wait: float = Field(
        300.0,
        ge=0,
        description="Seconds to wait out a verifier that restarts (its connections refused "
        "after it had answered, or loading its model) before giving up; the generation "
        "then goes on where it was.",
    )
    # -- the draft model ---------------------------------------------------------------
    model: Path = Field(
        DEFAULT_DRAFTER_MODEL,
        description="The draft model's GGUF file (a vocabulary other than the verifier's is "
        "drafted through text: --translate).",
    )
    n_gpu_layers: int | None = Field(
        None,
        ge=-1,
        description="Draft model layers on the GPU (default: all where the build has Metal "
        "or CUDA, else 0).",
    )
    threads: int = Field(
        0,
        ge=0,
        description="CPU threads for the draft model; 0: half the cores this process may use "
        "(at least one), so that it never starves a verifier or the user's other work on "
        "the same machine.",
    )
    verbose: bool = Field(False, description="Print llama.cpp's own log on stderr.")
    translate: bool = Field(
        True,
        description="Draft through text for a verifier with another tokenizer (off: refuse "
        "such a pair).",
    )
    # -- drafting ----------------------------------------------------------------------
    draft_n: DraftN = Field(
        "auto",
        description="Tokens drafted per round, or 'auto': with the model, the k with the "
        "most tokens per second expected from this generation's acceptance, verifier "
        "time, link time and drafting time (4 with --seed, so that the run repeats); "
        "with prompt lookup, x2 after a whole draft was accepted, else one past what was.",
    )
    drafter: DrafterKind = Field(
        DrafterKind.model_history,
        description="Who drafts: the draft model (model), prompt lookup (ngram, no model), the "
        "user's own history (suffix: this process's generations and --history-file, no "
        "model), or either lookup with the model behind it (model+ngram, model+suffix: "
        "where auto has the model step aside, the lookup's drafts still go while its "
        "rounds come as fast as the verifier's own tokens); model+history (the default): "
        "the model, and the user's history (as suffix's) only where the session's own text "
        "has no repeat the verifier copies, on a match of 12 tokens or more.",
    )
    history_file: Path | None = Field(
        None,
        description="With a drafter of the user's history (suffix, model+suffix, "
        "model+history): a file of earlier generations' tokens, read at start and each "
        "generation appended (JSON lines); none: this process's only.",
    )
    history_tokens: int = Field(
        200_000,
        ge=0,
        description="With a drafter of the user's history: the most tokens of it kept, the "
        "oldest generations dropped first.",
    )
    # A history draft says, in its acceptance and its speed, that the history holds the
    # text drafted: whoever shares a history can learn the others' texts by guessing.
    history_scope: HistoryScope = Field(
        HistoryScope.auto,
        description="`serve`: whose earlier requests a request is drafted from (the CLI "
        "keeps its own history). auto: user where `serve` listens on loopback with no "
        "client key and no CORS origin '*', else none; user: one history for every request "
        "(every client can learn every other's texts from how much of its answers was "
        "drafted and how fast they came); key: one history per client key (every client "
        "of one key can learn the others' texts so); none: no history across requests.",
    )
    pipeline: bool | None = Field(
        None,
        description="Draft the next round while this one is out, for its likeliest "
        "answers (default: on with a model drafter, except for seeded sampling).",
    )
    branches: int = Field(
        4,
        ge=1,
        le=16,
        description="Answers drafted for while a round is out, likeliest first, as long "
        "as the wait lasts (1: only every token accepted and the drafter's guess after).",
    )
    p_min: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Stop a draft where the draft model's probability of its token falls "
        "below this (0: off; drafts sampled for rejection sampling are never cut).",
    )
    # -- one generation (the default command) ------------------------------------------
    prompt: str | None = Field(None, description="The prompt text (required to generate).")
    chat: bool = Field(False, description="Apply the model's chat template to the prompt.")
    system: str | None = Field(None, description="A system message (with --chat).")
    max_tokens: int = Field(80, ge=1, description="Tokens to generate at most.")
    output: OutputFormat = Field(
        OutputFormat.text, description="Streamed text and a stats table, or one JSON object."
    )
    baseline: bool = Field(
        False,
        description="Also run the verifier alone on the same prompt and report the measured "
        "speedup.",
    )
    temperature: float = Field(
        0.0, ge=0.0, le=100.0, description="0 is greedy (exactly the verifier's own output)."
    )
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens (0: off).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass (1: off).")
    seed: int | None = Field(
        None, ge=0, lt=2**63, description="The same seed gives the same output."
    )
    strategy: Strategy | None = Field(
        None,
        description="How drafts are verified: greedy (at temperature 0), rejection (the "
        "default when sampling), match, or threshold (lossy).",
    )
    threshold: float | None = Field(
        None, gt=0.0, le=1.0, description="With --strategy threshold: accept when p >= this."
    )
    # -- `serve` -----------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="The address `serve` listens on.")
    port: int = Field(8080, ge=1, le=65535, description="The port `serve` listens on.")
    parallel: int = Field(
        2,
        ge=1,
        le=16,
        description="Generations `serve` runs at once, each on its own draft sequence and "
        "verifier session.",
    )
    queue: int = Field(
        8, ge=0, description="Requests `serve` keeps waiting beyond --parallel; more get 429."
    )
    max_body_bytes: int = Field(
        4 << 20,
        ge=1 << 10,
        description="The largest request body `serve` reads (413 beyond, before it is "
        "read); less once the verifier's context is known: no more than a request could "
        "use with it (a context's text as JSON, and the fields beside it).",
    )
    # An agent that sets no limit would otherwise write until the verifier's context is
    # full (llama.cpp's server stops only there), minutes of a CPU verifier's time for an
    # answer that rambles. A limit that a long answer, code included, still fits in.
    max_output_tokens: int = Field(
        4096,
        ge=1,
        description="Tokens an answer of `serve` may have where its request sets no limit "
        "(chat completions without max_tokens, the Responses API without "
        "max_output_tokens); a request's own limit wins.",
    )
    serve_api_key: str | None = Field(
        None,
        description="The key `serve`'s clients must send (Authorization: Bearer KEY, the "
        "OpenAI client's api_key), else 401, or several separated by commas (one for each "
        "person: with --history-scope key each has a history of its own); none: anyone "
        "who reaches its port may use it. Not the verifier's key (--api-key).",
    )
    serve_api_key_file: Path | None = Field(
        None,
        description="A file of keys for `serve`'s clients, one a line ('#' begins a "
        "comment line), beside --serve-api-key's.",
    )
    cors_origins: list[str] = Field(
        [],
        description="A browser origin allowed to call `serve` (CORS), e.g. "
        "http://localhost:3000, or '*' for any; repeat the flag for more "
        "(DRAFTER_CORS_ORIGINS: a JSON list).",
    )

    @field_validator("draft_n", mode="before")
    @classmethod
    def _draft_n(cls, value: object) -> DraftN:
        return parse_draft_n(value)

    @model_validator(mode="after")
    def _sampling_is_valid(self) -> DrafterSettings:
        self.request_options()  # raises a ValidationError naming the bad value
        return self

    def request_options(self) -> RequestOptions:
        """The one generation's options these settings say (the CLI's; `serve` makes
        each request's own from the request: RequestOptions.for_request)."""
        return RequestOptions(
            sampling=SamplingParams(
                temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed
            ),
            strategy=self.strategy,
            threshold=self.threshold,
            max_tokens=self.max_tokens,
            pipeline=self.pipeline,
        )
