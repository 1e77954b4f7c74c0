"""Wire protocol v2: the pydantic models both sides speak (docs/protocol.md).

Only token ids cross the wire. The drafter imports these models too, so a field
changed here changes both ends at once.
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

PROTOCOL_VERSION = 2  # 2: client-chosen session ids, X-Session-Id

# Strict: "1", 1.0 or true are not token ids; a client that sends them has a bug.
TokenId = Annotated[int, Strict(), Field(ge=0, lt=2**31)]
Probability = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]


class Strategy(StrEnum):
    """How a round's draft is judged (server/shared/acceptance.py)."""

    greedy = "greedy"
    rejection = "rejection"
    match = "match"
    threshold = "threshold"  # lossy


# Long enough to be a random choice (a UUID; 22 is 128 bits in base64): ids are one space
# for every key, so a guessable one could be taken or probed (409) by another.
SESSION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{21,63}$"
SESSION_ID = re.compile(SESSION_ID_PATTERN)
# Repeats the session id of /prefill, /verify and DELETE /sessions/{id} where a load
# balancer can hash it without reading the body (see the README's protocol section).
SESSION_ID_HEADER = "X-Session-Id"
# A cache scope is a proxy's opaque name for one of its own clients (a keyed hash, never
# the client's key): letters, digits, '-' and '_', bounded like a session id.
CACHE_SCOPE_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
# Which strategies keep the output distributed exactly as the verifier's own: all but one.
LOSSLESS: dict[Strategy, bool] = {strategy: strategy != Strategy.threshold for strategy in Strategy}
# Hard schema caps; the server's configured limits (max_draft, n_ctx) are tighter.
MAX_DRAFT_SCHEMA = 256
# A round without a draft may ask for this many of the verifier's own tokens at most.
MAX_CHUNK_TOKENS = 64
MAX_PROMPT_TOKENS_SCHEMA = 1 << 20
MAX_LOGIT_BIAS = 1024  # tokens a logit_bias may name
MAX_TOP_LOGPROBS = 20  # OpenAI's own limit
MAX_GRAMMAR_CHARS = 1 << 16
LogitBias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]


class WireModel(BaseModel):
    # Unknown fields are refused: a typo in a client must not be silently ignored.
    model_config = ConfigDict(extra="forbid")


class ResponseModel(BaseModel):
    # A newer server may add fields (protocol v2 grows compatibly): a client ignores them.
    model_config = ConfigDict(extra="ignore")


# The least temperature above 0 (vLLM's _SAMPLING_EPS): dividing logits by less
# overflows, and nobody means 1e-310 as anything but greedy.
MIN_TEMPERATURE = 1e-5


def _neutral(value: object) -> bool:
    return not value


class SamplingParams(WireModel):
    temperature: float = Field(
        0.0,
        ge=0.0,
        le=100.0,
        allow_inf_nan=False,
        description=f"0 = greedy; otherwise at least {MIN_TEMPERATURE}",
    )
    top_k: int = Field(0, ge=0, le=1 << 20, description="0 = no top-k cut")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False, description="1 = no nucleus cut")
    seed: int | None = Field(None, ge=0, lt=2**63)
    # Applied to the verifier's logits before the rest, row by row (the drafter's too, so
    # that its drafts follow): OpenAI's and vLLM's meaning, server/shared/penalties.py.
    # Left out of the JSON when neutral, so that a verifier older than them reads it.
    presence_penalty: float = Field(
        0.0,
        exclude_if=_neutral,
        ge=-2.0,
        le=2.0,
        allow_inf_nan=False,
        description="subtracted from the logit of every token generated so far",
    )
    frequency_penalty: float = Field(
        0.0,
        exclude_if=_neutral,
        ge=-2.0,
        le=2.0,
        allow_inf_nan=False,
        description="subtracted from a token's logit once for each time it was generated",
    )
    logit_bias: dict[Annotated[int, Field(ge=0, lt=2**31)], LogitBias] = Field(
        default_factory=dict,
        exclude_if=_neutral,
        max_length=MAX_LOGIT_BIAS,
        description="token id -> a value added to its logit (-100 bans it, 100 all but forces it)",
    )

    @field_validator("temperature")
    @classmethod
    def _not_denormal(cls, temperature: float) -> float:
        if 0.0 < temperature < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return temperature

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties or biases change the logits (server/shared/penalties.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


class Grammar(WireModel):
    """A grammar the verifier decodes under (server/shared/constraint.py): its rows masked
    to what the grammar allows after the tokens before them."""

    kind: Literal["json_schema", "lark", "gbnf", "regex"]
    source: str | dict[Any, Any] = Field(
        description="the grammar's text; for json_schema, the schema (an object, or its JSON)"
    )

    @field_validator("source")
    @classmethod
    def _bounded(cls, source: str | dict[Any, Any]) -> str | dict[Any, Any]:
        size = len(source) if isinstance(source, str) else len(json.dumps(source))
        if size > MAX_GRAMMAR_CHARS:
            raise ValueError(f"a grammar of {size} characters; at most {MAX_GRAMMAR_CHARS}")
        return source


class PromptInput(WireModel):
    # Exactly one of the two, said in the schema too (OpenAPI clients and fuzzers read it).
    model_config = ConfigDict(
        json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["prompt_tokens"]}]}
    )

    # Absent (None), never null: typed as what a client may send, so that a null is refused.
    prompt: str = Field(None, max_length=4 << 20)  # type: ignore[assignment]
    prompt_tokens: list[TokenId] = Field(None, max_length=MAX_PROMPT_TOKENS_SCHEMA)  # type: ignore[arg-type]
    add_bos: bool = Field(True, description="add BOS if the model's vocabulary asks for it")

    @model_validator(mode="after")
    def _one_prompt(self) -> PromptInput:
        if (self.prompt is None) == (self.prompt_tokens is None):
            raise ValueError("give exactly one of 'prompt' or 'prompt_tokens'")
        return self


class PrefillRequest(PromptInput):
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    grammar: Grammar | None = Field(
        None,
        exclude_if=lambda v: v is None,
        description="decode under this grammar, every round (it travels once: here)",
    )
    strategy: Strategy | None = Field(
        None,
        description="greedy (temperature 0, the default then), rejection (the default when "
        "sampling; needs draft_probs), match (sample-and-match), threshold (LOSSY)",
    )
    threshold: float | None = Field(
        None, gt=0.0, le=1.0, description="with strategy=threshold: accept when p(x) >= this"
    )
    generated_tokens: int = Field(
        0,
        ge=0,
        exclude_if=_neutral,
        description="the last this many prompt tokens were generated by an earlier session "
        "of the same generation (a client opening it again): penalties count them, a grammar's "
        "state is after them",
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        exclude_if=lambda v: v is None,
        description="with each committed token, its log-probability under the verifier's "
        "distribution and this many likeliest tokens' (0: its own only); none without it",
    )
    session_id: str | None = Field(
        None,
        pattern=SESSION_ID_PATTERN,
        description="the new session's id, chosen by the client (22 to 64 letters, digits, "
        "'-' or '_': a random UUID, never a guessable name) so that a balancer can route "
        "every request of the session by its X-Session-Id header; 409 session_exists if "
        "one has it. Without it the server chooses",
    )
    cache_scope: str | None = Field(
        None,
        pattern=CACHE_SCOPE_PATTERN,
        exclude_if=lambda v: v is None,
        description="a proxy's opaque name for the client it opens the session for (1 to "
        "64 letters, digits, '-' or '_'): cached prefixes are reused only within the same "
        "API key and scope, so that its clients cannot read each other's prompts from "
        "cached_tokens. Without it, within the API key",
    )


class PrefillResponse(ResponseModel):
    session_id: str
    prompt_ids: list[int]
    prompt_len: int
    total_tokens: int
    strategy: Strategy
    lossless: bool
    cached_tokens: int = Field(
        0,
        description="prompt tokens taken from a cached prefix of the same API key (and "
        "cache_scope), not evaluated again",
    )
    advised_draft: int | None = Field(
        None, description="the draft length the verifier advises the first round (as /verify's)"
    )
    grammar_token_limit: int | None = Field(
        None,
        exclude_if=lambda v: v is None,
        description="where the verifier cannot prove the session's grammar can end (a way to "
        "its end through a part it does not read): the most tokens the session may generate, "
        "the prompt's generated_tokens counted; a round's draft is verified as far as fits "
        "(draft_verified), a round at it is refused (400 grammar_token_limit). None: no "
        "limit but the context",
    )


class VerifyRequest(WireModel):
    session_id: str = Field(min_length=1, max_length=128)
    n_past: Annotated[int, Strict()] = Field(
        ge=0, lt=2**31, description="tokens the drafter believes are committed"
    )
    draft_tokens: list[TokenId] = Field(default_factory=list, max_length=MAX_DRAFT_SCHEMA)
    draft_probs: list[list[tuple[TokenId, Probability]]] | None = Field(
        None, max_length=MAX_DRAFT_SCHEMA
    )
    chunk_tokens: Annotated[int, Strict()] | None = Field(
        None,
        ge=1,
        le=MAX_CHUNK_TOKENS,
        description="a round without a draft (k = 0): the verifier decodes this many tokens "
        "of its own, one pass each, and answers them together (None: one); with a lookup's "
        "draft_accept, the round where none of that draft pays",
    )
    draft_kind: Literal["lookup"] | None = Field(
        None,
        description="`lookup`: the draft copies earlier text (prompt lookup, a suffix match), "
        "judged as any draft but kept out of the acceptance the advice is made from, which "
        "is a draft model's (None)",
    )
    draft_accept: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="with draft_kind `lookup`: the client's estimate of how often a token of "
        "this draft is accepted. The verifier then verifies only the part of the draft its "
        "cost of a pass says pays (`draft_verified`), and where none pays, the round is a "
        "chunk of chunk_tokens instead (None: one token)",
    )

    @model_validator(mode="after")
    def _chunk_without_draft(self) -> VerifyRequest:
        if self.draft_accept is not None:
            if self.draft_kind != "lookup":
                raise ValueError("draft_accept is for a draft of draft_kind 'lookup'")
        elif self.chunk_tokens is not None and self.chunk_tokens > 1 and self.draft_tokens:
            raise ValueError(
                "chunk_tokens above 1 is for a round without draft_tokens (or a lookup's "
                "with draft_accept)"
            )
        return self


class RoundTimings(ResponseModel):
    decode_ms: float = Field(description="time spent in llama_decode for this round")
    engine_ms: float = Field(
        0.0,
        description="the round's time in the engine: checks, llama_decode (shared with "
        "the sessions batched with it), acceptance. The rest of a round trip is protocol: "
        "HTTP, JSON, the hand-off between threads, the network",
    )
    decoded_tokens: int = Field(description="tokens evaluated for this round (k + 1)")


class TokenLogprob(ResponseModel):
    """A committed token's log-probability, and the likeliest tokens' at its position."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list)


class VerifyResponse(ResponseModel):
    accepted_prefix_len: int
    tokens: list[int] = Field(
        description="draft_tokens[:m] + one token chosen by the target (a chunk: its tokens)"
    )
    preds: list[int] = Field(
        description="the target's argmax at each of the k+1 positions (a chunk: at each token)"
    )
    total_tokens: int
    eos: bool
    strategy: Strategy
    lossless: bool
    timings: RoundTimings
    advised_draft: int | None = Field(
        None,
        description="the draft length the verifier advises this session's next round (0: "
        "drafting cannot pay here now); from what its passes cost, how many sessions share "
        "them and this session's acceptance (docs/architecture.md)",
    )
    pass_sessions: float | None = Field(
        None, description="sessions the verifier's recent passes of rounds held (1: alone)"
    )
    draft_verified: int | None = Field(
        None,
        exclude_if=lambda v: v is None,
        description="where the round's draft was sized (draft_accept) or cut to share a "
        "pass with other keys' rounds: how many of its tokens were verified, its first; "
        "accepted_prefix_len counts within them (0: none verified, and `tokens` are the "
        "chunk's)",
    )
    logprobs: list[TokenLogprob] | None = Field(
        None,
        exclude_if=lambda v: v is None,
        description="one for each of `tokens`, where the session asked for them (prefill's "
        "logprobs)",
    )


class GenerateRequest(PromptInput):
    max_tokens: int = Field(64, ge=1, le=1 << 20)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    grammar: Grammar | None = Field(None, exclude_if=lambda v: v is None)


class GenerateTimings(ResponseModel):
    prompt_ms: float
    decode_ms: float
    total_ms: float
    tokens_per_s: float


class GenerateResponse(ResponseModel):
    prompt_ids: list[int]
    tokens: list[int]
    text: str
    eos: bool
    timings: GenerateTimings
    grammar_token_limit: int | None = Field(
        None,
        exclude_if=lambda v: v is None,
        description="as /prefill's: the tokens stop there, where the grammar's end is unproven",
    )


class HealthResponse(ResponseModel):
    status: Literal["ok", "loading", "error"]
    detail: str | None = None


class ErrorDetail(ResponseModel):
    code: int
    type: str
    message: str


class ErrorBody(ResponseModel):
    error: ErrorDetail


def strategy_for(strategy: Strategy | None, sampling: SamplingParams) -> Strategy:
    """The strategy asked for, or the natural one for the sampling: greedy at temperature
    0, else rejection sampling. One rule for the drafter and the verifier."""
    return strategy or (Strategy.greedy if sampling.greedy else Strategy.rejection)
