"""The responses `serve` answers, as pydantic models of OpenAI's shapes (completions, chat
completions, their stream chunks, models), with its own `speculative` figures."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


def _absent_if_none(value: object) -> bool:
    return value is None


# A field OpenAI leaves out where it has nothing (others it sends as null: a chunk's
# `finish_reason` and `logprobs`, which clients read by key).
Optional = Field(None, exclude_if=_absent_if_none)


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
    draft_cached_tokens: int = 0  # not counted (0) for a pair with another tokenizer


FinishReason = Literal["stop", "length", "tool_calls"]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    """A generated token's log-probability under the verifier's distribution (chat)."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class CompletionLogprobs(BaseModel):
    """The completions API's older shape: parallel lists, `text_offset` in characters."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolCallDelta(ToolCall):
    index: int = 0  # which of the message's calls (one at most here)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: a tool call
    tool_calls: list[ToolCall] | None = Optional


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = Optional
    content: str | None = Optional
    tool_calls: list[ToolCallDelta] | None = Optional


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class _Response(BaseModel):
    id: str
    created: int
    model: str
    system_fingerprint: str
    usage: Usage | None = Optional
    speculative: SpeculativeFigures | None = Optional


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
