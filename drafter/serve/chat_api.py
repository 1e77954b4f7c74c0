"""The slice of the OpenAI API that `serve` speaks, requests and responses as pydantic
models of OpenAI's shapes (completions, chat completions, their stream chunks, models).

Fields of OpenAI's API that change nothing here (user, metadata...) are accepted and
ignored. Fields that would change the output and are not implemented are refused with a
400 naming them (`unsupported_fields`), never silently dropped, and so is a field no API
has (`unknown_fields`: `max_token` is a 400 that suggests `max_tokens`).
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from server.shared.protocol import (
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_TOP_LOGPROBS,
    MIN_TEMPERATURE,
    LogitBias,
    SamplingParams,
    TokenId,
)

MAX_STOPS = 4  # OpenAI's own limit
MAX_STOP_CHARS = 1000
MAX_PROMPT_CHARS = 1 << 20
MAX_PROMPT_TOKENS = 1 << 20
# Choices of one request (prompts times n), generated one after another.
MAX_CHOICES = 16
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's own limit
MAX_TOOLS = 128  # OpenAI's own limit
MAX_TOOL_CALLS = 128
# Deep enough for any tool's arguments, shallow enough that json's parser and encoder,
# which recurse a level at a time, read and write them again wherever a prompt is made.
MAX_ARGUMENTS_DEPTH = 64

Seed = Annotated[int, Field(ge=0, lt=2**63)]


# Lone surrogates ("\ud800", which JSON can carry) are refused where any body is read,
# in any field (server/shared/request_body.py: read_json).
Text = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


# Request fields that would change the output, with the value that changes nothing.
UNSUPPORTED: dict[str, Any] = {
    "best_of": (None, 1),
    "functions": (None, []),
    "function_call": (None, "none"),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
}


# Request fields of OpenAI's API that change nothing here: accepted and ignored.
IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "parallel_tool_calls",  # completions call no tools (chat's is a field)
    }
)
# Fields of llama.cpp's server that its clients send: not supported here, refused unless
# they hold the value that changes nothing.
LOCAL_SERVER_FIELDS: dict[str, Any] = {
    "min_p": (None, 0, 0.0),
    "typical_p": (None, 1, 1.0),
    "repeat_penalty": (None, 1, 1.0),
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
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices, one after another")
    # On the verifier's distribution, row by row (server/shared/penalties.py).
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[Annotated[int, Field(ge=0, lt=2**31)], LogitBias] | None = Field(
        None, max_length=MAX_LOGIT_BIAS
    )
    top_k: int = Field(0, ge=0, le=1 << 20)  # llama.cpp's field: 0 is off
    # llama.cpp's fields for constrained output (chat's `response_format` is OpenAI's).
    grammar: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | None = None
    json_schema: dict[str, Any] | None = None

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

    def why_unsupported(self, name: str) -> str:
        return ""

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, choice: int = 0) -> SamplingParams:
        """The verifier's sampling for the request's `choice`-th choice: a temperature
        below MIN_TEMPERATURE is greedy here, as OpenAI-style servers (vLLM) read it; a
        seed is the first choice's, and one more each choice after it."""
        temperature = self.temperature if self.temperature >= MIN_TEMPERATURE else 0.0
        seed = None if self.seed is None else (self.seed + choice) % 2**63
        return SamplingParams(
            temperature=temperature,
            top_k=self.top_k if temperature else 0,
            top_p=self.top_p if temperature else 1.0,
            seed=seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias or {},
        )

    def logprobs_top(self) -> int | None:
        """How many likeliest tokens to show with each generated token's logprob (None:
        no logprobs)."""
        raise NotImplementedError


TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]


class CompletionRequest(_Request):
    # A text, texts, token ids (the model's), or lists of them: a choice (n of them) each.
    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICES)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_CHOICES)]
    )
    max_tokens: int | None = Field(16, ge=1)  # the OpenAI default for completions
    echo: bool = False
    suffix: Text | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    @model_validator(mode="after")
    def _choices_fit(self) -> CompletionRequest:
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} choices (prompts times n) a request")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported: no prompt logprobs here")
        return self

    def logprobs_top(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: Text


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_A_BRACKET = re.compile(r"[^\[\]{}]+")
_BRACKET_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_depth(text: str) -> int:
    """How deep a JSON text's arrays and objects nest (brackets inside its strings not
    counted), found without recursing: recursion is what a deep text breaks."""
    if text.count("[") + text.count("{") == 0:
        return 0
    brackets = _NOT_A_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(accumulate(map(_BRACKET_STEP.__getitem__, brackets)), default=0)


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Text
    arguments: Text  # JSON, as the model wrote it

    @field_validator("arguments")
    @classmethod
    def _not_too_deep(cls, arguments: str) -> str:
        if json_depth(arguments) > MAX_ARGUMENTS_DEPTH:
            raise ValueError(f"nested deeper than {MAX_ARGUMENTS_DEPTH} levels")
        return arguments


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    # None only in an assistant's message that calls tools (a conversation replayed).
    content: Text | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOL_CALLS)
    tool_call_id: Text | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required, except in an assistant's tool calls")
        return self

    @property
    def text(self) -> str:
        """The message as the chat template gets it; an assistant's tool calls after its
        text, each as the Hermes format writes one (`<tool_call>` JSON `</tool_call>`)."""
        if self.content is None or isinstance(self.content, str):
            text = self.content or ""
        else:
            text = "".join(part.text for part in self.content)
        for call in self.tool_calls or ():
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:  # as the model wrote it, if it wrote no JSON
                arguments = call.function.arguments
            called = json.dumps({"name": call.function.name, "arguments": arguments})
            text += f"\n<tool_call>\n{called}\n</tool_call>"
        return text.lstrip("\n")


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # Several calls in one answer (OpenAI's default); false: one at most.
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        form = self.response_format
        if form is not None and form.type == "json_schema" and form.json_schema is None:
            raise ValueError("response_format json_schema needs its json_schema")
        names = [t.function.name for t in self.tools or ()]
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names {self.tool_choice.function.name!r}, "
                    "which is not one of the tools"
                )
        elif self.tool_choice in ("auto", "required") and not names:
            raise ValueError(f"tool_choice {self.tool_choice!r} needs tools")
        if self.calls_tools and self.logprobs:
            raise ValueError("logprobs with tools are not supported here")
        return self

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may be a tool call (tools given, and not tool_choice none)."""
        return bool(self.tools) and self.tool_choice != "none"

    def logprobs_top(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
