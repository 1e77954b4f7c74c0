"""Anthropic's Messages API (`POST /v1/messages`) as a request of the one chat model
`serve` generates from (drafter/serve/chat_api.py): `system` as the system message, text
blocks as text, an assistant's `tool_use` blocks as its tool calls, a user's
`tool_result` blocks as tool messages, `tools` with their `input_schema` as chat's tools,
`tool_choice` `any` as `required`, `stop_sequences` as `stop`."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
)

from drafter.serve.chat_api import (
    MAX_STOPS,
    MAX_TOOLS,
    ChatCompletionRequest,
    Text,
)
from drafter.serve.edge_request import EdgeRequest, edge_error, not_too_deep
from drafter.serve.errors import invalid_request

MAX_BLOCKS = 1024
# Claude Code's first system block: an attribution line for Anthropic's billing, whose
# value changes between conversations (`cc_version=...<hash of the first message>`) and,
# in some versions, every request (`cch=...`). It tells the model nothing, and at the head
# of the prompt it would make every request's prompt differ from the first tokens on:
# nothing the verifier cached could be reused. So it is left out of the prompt.
BILLING_HEADER = "x-anthropic-billing-header:"
MAX_CONTEXT_EDITS = 16
# The chat request's fields, as this API names them (in its refusals).
FIELDS = {"stop": "stop_sequences", "response_format": "output_config.format"}


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations: nothing here

    type: Literal["text"]
    text: Text


class ToolUseBlock(BaseModel):
    """A call the model made earlier, replayed."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_use"]
    id: Text
    name: Text
    input: Annotated[dict[str, Any], AfterValidator(not_too_deep)]


class ToolResultBlock(BaseModel):
    """What the client's tool returned for a call."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    is_error: bool = False

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            text = self.content or ""
        else:
            text = "".join(block.text for block in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(BaseModel):
    """An earlier answer's reasoning, replayed by a client that had another model answer:
    dropped (these models do not reason, and their templates have no place for it)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["thinking", "redacted_thinking"]


def _block_type(block: Any) -> str:
    return block.get("type", "") if isinstance(block, dict) else getattr(block, "type", "")


Block = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[ThinkingBlock, Tag("redacted_thinking")],
    Discriminator(_block_type),
]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # `system` mid-conversation: Claude Code's reminders (its `mid-conversation-system`
    # beta), text only, written as a system turn where they stand.
    role: Literal["user", "assistant", "system"]
    # The list first: a bad block is what its errors name (a bad text says little).
    content: Annotated[list[Block], Field(min_length=1, max_length=MAX_BLOCKS)] | Text

    def blocks(self) -> list[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock]:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control

    type: Literal["custom"] | None = None  # server tools (web search...) are not run here
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    input_schema: Annotated[dict[str, Any], AfterValidator(not_too_deep)]


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False  # true: one call at most


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], AfterValidator(not_too_deep)] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: OutputFormat | None = None
    effort: str | None = None  # these models do not reason: no effect


class MessagesRequest(EdgeRequest):
    IGNORED: ClassVar[frozenset[str]] = frozenset(
        {
            "metadata",
            "service_tier",
            "thinking",  # these models do not reason
            "container",
            "cache_control",  # the verifier reuses prompts without being asked
            "diagnostics",
            "inference_geo",
            "speed",
            "user_profile_id",
            "workspace_id",
        }
    )
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "mcp_servers": (None, []),
        # Its edits would change the prompt, but for clearing thinking (unsupported_fields).
        "context_management": (None,),
    }

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1, max_length=MAX_BLOCKS)
    system: Text | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0, le=1 << 20)
    stop_sequences: list[Text] | None = None
    stream: bool = False
    tools: list[AnthropicTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None

    def unsupported_fields(self) -> list[str]:
        refused = super().unsupported_fields()
        edits = (self.model_extra or {}).get("context_management")
        if "context_management" in refused and _clears_thinking_only(edits):
            refused.remove("context_management")
        return refused

    def prefill(self) -> str:
        """A last message of the assistant's: the answer's beginning, which it continues
        (Anthropic's prefill); "" where the last message is the user's."""
        last = self.messages[-1]
        if last.role != "assistant":
            return ""
        blocks = last.blocks()
        if not all(isinstance(block, TextBlock | ThinkingBlock) for block in blocks):
            raise invalid_request(
                "a last assistant message continues as text: it holds text blocks only",
                f"messages.{len(self.messages) - 1}.content",
            )
        return "".join(block.text for block in blocks if isinstance(block, TextBlock))

    def to_chat(self) -> ChatCompletionRequest:
        """The same request as chat completions' (a 400 where it has no such form)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self._messages(),
            "stream": self.stream,
            "max_tokens": self.max_tokens,
        }
        for name in ("temperature", "top_p", "top_k"):
            if (value := getattr(self, name)) is not None:
                body[name] = value
        if self.stop_sequences:
            if len(self.stop_sequences) > MAX_STOPS:
                raise invalid_request(f"stop_sequences: at most {MAX_STOPS} here", "stop_sequences")
            body["stop"] = self.stop_sequences
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.input_schema,
                    },
                }
                for t in self.tools
            ]
        form = self.output_config.format if self.output_config is not None else None
        if form is not None:
            json_schema = {"name": "output", "schema": form.schema_, "strict": True}
            body["response_format"] = {"type": "json_schema", "json_schema": json_schema}
        choice = self.tool_choice
        if choice is not None and choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
        if choice is not None and choice.type == "tool":
            if choice.name is None:
                raise invalid_request("tool_choice tool needs its name", "tool_choice.name")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        # `auto` without tools asks for nothing (some clients always send it).
        elif choice is not None and (self.tools or choice.type != "auto"):
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        try:
            chat = ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise edge_error(exc, FIELDS) from None
        if self.prefill() and (chat.calls_tools or chat.response_format is not None):
            # The constraint holds a whole answer, and the prefill is its beginning.
            raise invalid_request(
                "a last assistant message (prefill) with tools or output_config.format "
                "is not supported here",
                f"messages.{len(self.messages) - 1}",
            )
        return chat

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system
            if isinstance(system, str):
                text = system
            else:
                text = "".join(b.text for b in system if not b.text.startswith(BILLING_HEADER))
            if text:
                messages.append({"role": "system", "content": text})
        if self.messages[0].role == "system":
            raise invalid_request(
                "messages.0.role: a conversation begins with the user's or the assistant's "
                "message; the system prompt is `system`",
                "messages.0.role",
            )
        called: set[str] = set()
        replayed = self.messages[:-1] if self.prefill() else self.messages
        for i, message in enumerate(replayed):
            texts: list[str] = []
            calls: list[dict[str, Any]] = []
            for j, block in enumerate(message.blocks()):
                at = f"messages.{i}.content.{j}"
                if isinstance(block, TextBlock):
                    texts.append(block.text)
                elif message.role == "system":
                    raise invalid_request(f"{at}: a system message holds text blocks only", at)
                elif isinstance(block, ThinkingBlock):
                    if message.role != "assistant":
                        raise invalid_request(f"{at}: {block.type} blocks are the assistant's", at)
                elif isinstance(block, ToolUseBlock):
                    if message.role != "assistant":
                        raise invalid_request(f"{at}: tool_use blocks are the assistant's", at)
                    arguments = json.dumps(block.input)
                    called.add(block.id)
                    function = {"name": block.name, "arguments": arguments}
                    calls.append({"id": block.id, "function": function})
                else:
                    if message.role != "user":
                        raise invalid_request(f"{at}: tool_result blocks are the user's", at)
                    if block.tool_use_id not in called:
                        raise invalid_request(
                            f"{at}: tool_result for {block.tool_use_id!r}, which no earlier "
                            "tool_use block made",
                            f"{at}.tool_use_id",
                        )
                    messages.append(
                        {"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text}
                    )
            if calls:
                messages.append(
                    {"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls}
                )
            elif texts:
                messages.append({"role": message.role, "content": "".join(texts)})
        return messages


class CountTokensRequest(MessagesRequest):
    """`/v1/messages/count_tokens`: a message request without `max_tokens`."""

    max_tokens: int = Field(1, ge=1)


def _clears_thinking_only(value: Any) -> bool:
    """`context_management` whose edits only clear thinking (what Claude Code sends): no
    change here, where no thinking reaches the prompt (replayed thinking blocks are
    dropped). Other edits (clearing tool results...) would change the prompt: refused."""
    if not isinstance(value, dict) or set(value) - {"edits"}:
        return False
    edits = value.get("edits")
    return (
        isinstance(edits, list)
        and len(edits) <= MAX_CONTEXT_EDITS
        and all(
            isinstance(edit, dict)
            and isinstance(edit.get("type"), str)
            and edit["type"].startswith("clear_thinking_")
            for edit in edits
        )
    )
