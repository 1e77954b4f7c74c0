"""The slice of the OpenAI API that `serve` speaks, requests and responses as pydantic
models of OpenAI's shapes (completions, chat completions, their stream chunks, models).

Fields of OpenAI's API that change nothing here (user, metadata...) are accepted and
ignored. Fields that would change the output and are not implemented are refused with a
400 naming them (`unsupported_fields`), never silently dropped, and so is a field no API
has (`unknown_fields`: `max_token` is a 400 that suggests `max_tokens`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from server.shared.protocol import MIN_TEMPERATURE, SamplingParams

MAX_STOPS = 4  # OpenAI's own limit
MAX_STOP_CHARS = 1000
MAX_PROMPT_CHARS = 1 << 20

Seed = Annotated[int, Field(ge=0, lt=2**63)]


def _no_lone_surrogates(text: str) -> str:
    """JSON can carry "\\ud800"; no tokenizer can encode it: refused as input."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode text (a lone surrogate at {exc.start})") from None
    return text


Text = Annotated[str, Field(max_length=MAX_PROMPT_CHARS), AfterValidator(_no_lone_surrogates)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


# Request fields that would change the output, with the value that changes nothing.
UNSUPPORTED: dict[str, Any] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
}


# Request fields of OpenAI's API that change nothing here: accepted and ignored.
IGNORED = frozenset(
    {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
)
# Fields of llama.cpp's server that its clients send: not supported here, refused unless
# they hold the value that changes nothing.
LOCAL_SERVER_FIELDS: dict[str, Any] = {
    "top_k": (None, 0),
    "min_p": (None, 0, 0.0),
    "typical_p": (None, 1, 1.0),
    "repeat_penalty": (None, 1, 1.0),
    "grammar": (None, ""),
    "json_schema": (None, {}),
    "n_predict": (None,),
    "mirostat": (None, 0),
}


class _Request(BaseModel):
    # Checked by hand (unknown_fields, unsupported_fields): an error names the field.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: Seed | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="only 1")

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        for item in stops:
            if len(item) > MAX_STOP_CHARS:
                raise ValueError(f"a stop sequence is at most {MAX_STOP_CHARS} characters")
        return stop

    def unsupported_fields(self) -> list[str]:
        extra = self.model_extra or {}
        refused = UNSUPPORTED | LOCAL_SERVER_FIELDS
        return sorted(name for name, ok in refused.items() if extra.get(name) not in ok)

    def unknown_fields(self) -> list[str]:
        """Fields no API this server speaks has (a misspelling, most likely)."""
        known = UNSUPPORTED.keys() | LOCAL_SERVER_FIELDS.keys() | IGNORED
        return sorted(set(self.model_extra or {}) - known)

    def known_fields(self) -> list[str]:
        return [*type(self).model_fields, *UNSUPPORTED, *IGNORED]

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self) -> SamplingParams:
        """The verifier's sampling: a temperature below MIN_TEMPERATURE is greedy here, as
        OpenAI-style servers (vLLM) read it."""
        temperature = self.temperature if self.temperature >= MIN_TEMPERATURE else 0.0
        return SamplingParams(
            temperature=temperature, top_p=self.top_p if temperature else 1.0, seed=self.seed
        )


class CompletionRequest(_Request):
    prompt: Text
    max_tokens: int | None = Field(16, ge=1)  # the OpenAI default for completions


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(None, ge=1)


# -- responses --------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # the verifier's reuse of an earlier prompt's prefix


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class SpeculativeFigures(BaseModel):
    """Extension field: what the speculative loop did for this response."""

    strategy: str
    lossless: bool
    vocab: str = "same"  # the drafter's vocabulary against the verifier's
    rounds: int
    drafted: int
    accepted: int
    acceptance_rate: float
    tokens_per_round: float
    recoveries: int
    # Prompt tokens the draft model still had in its cache from an earlier request.
    draft_cached_tokens: int = 0


FinishReason = Literal["stop", "length"]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None
    logprobs: None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None
    logprobs: None = None


class _Response(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage | None = None
    speculative: SpeculativeFigures | None = None


class Completion(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "hetero-specdecode"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
