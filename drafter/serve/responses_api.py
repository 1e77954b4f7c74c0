"""OpenAI's Responses API (`POST /v1/responses`), its stateless core, as a request of the
one chat model `serve` generates from (drafter/serve/chat_api.py): `input` as a text or
items (messages, earlier function calls and their outputs replayed), `instructions` as
the system message, `text.format` as `response_format`, function tools as chat's tools.
A response is not kept (`store` true and `previous_response_id` are refused): a client
sends the conversation's items each turn, and the verifier's prompt reuse keeps what an
earlier turn evaluated."""

from __future__ import annotations

import logging
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    ValidatorFunctionWrapHandler,
    model_validator,
)

from drafter.serve.chat_api import (
    MAX_ARGUMENTS_DEPTH,
    MAX_TOOLS,
    ChatCompletionRequest,
    FunctionSpec,
    JsonSchemaFormat,
    Text,
    json_depth,
)
from drafter.serve.edge_request import EdgeRequest, edge_error, not_too_deep
from drafter.serve.errors import invalid_request

log = logging.getLogger(__name__)

MAX_ITEMS = 1024
# Tools OpenAI runs on its side (web search, file search, a code interpreter, image
# generation), or whose calls come back in item shapes other than `function_call` (a local
# shell, custom tools with their own grammar, namespaces of functions): none can be called
# here. An agent offers them with every request whatever the provider (Codex sends
# `web_search`), so they are left out of the prompt, logged, and absent from the response's
# echoed `tools`, rather than refused; a tool type none of these is still a 400.
HOSTED_TOOL = re.compile(
    r"(web_search|web_search_preview|file_search|code_interpreter|image_generation"
    r"|local_shell|shell|apply_patch|custom|computer_use|computer_use_preview|mcp"
    r"|namespace|tool_search)(_\d{4}_\d{2}_\d{2})?"
)
LOGPROBS = "message.output_text.logprobs"
# The chat request's fields, as this API names them (in its refusals).
FIELDS = {"messages": "input", "response_format": "text.format"}


class ContentText(BaseModel):
    """A message's text part: the user's (`input_text`) or an earlier answer's."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text"]
    text: Text


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | Annotated[list[ContentText], Field(max_length=MAX_ITEMS)]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    """A call the model made earlier, replayed."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text


class FunctionCallOutputItem(BaseModel):
    """What the client's function returned for a call."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: Text
    output: Text | Annotated[list[ContentText], Field(max_length=MAX_ITEMS)]

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


def _item_type(item: Any) -> str:
    # A message may leave its type out (OpenAI's "easy" input message).
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: Annotated[dict[str, Any] | None, AfterValidator(not_too_deep)] = None
    strict: bool | None = None  # a call always validates here


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema_: Annotated[dict[str, Any] | None, AfterValidator(not_too_deep)] = Field(
        None, alias="schema"
    )
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None
    # Asks a model that has it for longer or shorter answers; these models have no such
    # setting, so every value answers the same (Codex sends `low`).
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(EdgeRequest):
    IGNORED: ClassVar[frozenset[str]] = frozenset(
        {
            "user",
            "service_tier",
            "prompt_cache_key",
            "prompt_cache_retention",
            "prompt_cache_options",
            "truncation",  # `auto` or not, a prompt the context cannot hold is a 400 here
            "safety_identifier",
            "max_tool_calls",
            "reasoning",  # these models do not reason
            "stream_options",
            "client_metadata",  # Codex's ids of its session and turn
        }
    )
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "store": (None, False),
        "previous_response_id": (None,),
        "conversation": (None,),
        "prompt": (None,),
        "background": (None, False),
        "top_logprobs": (None, 0),
        "context_management": (None,),
    }
    WHY: ClassVar[dict[str, str]] = {
        "include": f"{LOGPROBS}: no logprobs through this API",
        "store": "responses are not kept here: send the conversation's items in `input`",
        "previous_response_id": "responses are not kept here: send the conversation's items "
        "in `input`",
    }

    model: str | None = None
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_ITEMS)]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None  # None: allowed, as OpenAI's default is
    stream: bool = False
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)
    # What else to include: the only one that would change the output here is logprobs.
    include: list[Annotated[str, Field(max_length=100)]] | None = Field(None, max_length=32)
    _left_out: list[str] = PrivateAttr(default_factory=list)  # the hosted tools' types

    @model_validator(mode="wrap")
    @classmethod
    def _hosted_tools_left_out(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(data, cls):  # a request already made (its body validated where read)
            return handler(data)
        left_out: list[str] = []
        tools = data.get("tools") if isinstance(data, dict) else None
        if isinstance(tools, list) and len(tools) <= MAX_TOOLS:  # more: refused as they are
            kept = []
            for tool in tools:
                kind = tool.get("type") if isinstance(tool, dict) else None
                if isinstance(kind, str) and HOSTED_TOOL.fullmatch(kind):
                    left_out.append(kind)
                else:
                    kept.append(tool)
            data = {**data, "tools": kept}
        request = handler(data)
        request._left_out = left_out
        return request

    @property
    def left_out_tools(self) -> list[str]:
        """The types of the tools offered that cannot be called here."""
        return list(self._left_out)

    def unsupported_fields(self) -> list[str]:
        refused = super().unsupported_fields()
        return [*refused, "include"] if LOGPROBS in (self.include or ()) else refused

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def to_chat(self) -> ChatCompletionRequest:
        """The same request as chat completions' (a 400 where it has no such form)."""
        if self._left_out:
            log.info("tools left out (not callable here): %s", ", ".join(self._left_out))
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self._messages(),
            "stream": self.stream,
        }
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.top_p is not None:
            body["top_p"] = self.top_p
        form = self.text.format if self.text is not None else None
        if form is not None and form.type != "text":
            schema = form.schema_ if form.type == "json_schema" else None
            if form.type == "json_schema" and schema is None:
                raise invalid_request("text.format json_schema needs its schema", "text.format")
            body["response_format"] = {"type": form.type}
            if schema is not None:
                body["response_format"]["json_schema"] = JsonSchemaFormat(
                    name=form.name, schema=schema, strict=form.strict
                ).model_dump(by_alias=True)
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": FunctionSpec(**t.model_dump(exclude={"type", "strict"})),
                }
                for t in self.tools
            ]
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if isinstance(self.tool_choice, FunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        # `auto` without tools asks for nothing (some clients always send it).
        elif self.tool_choice is not None and (self.tools or self.tool_choice != "auto"):
            body["tool_choice"] = self.tool_choice
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise edge_error(exc, FIELDS) from None

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        called: set[str] = set()
        for i, item in enumerate(self.items()):
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text})
            elif isinstance(item, FunctionCallItem):
                if json_depth(item.arguments) > MAX_ARGUMENTS_DEPTH:
                    raise invalid_request(
                        f"input.{i}.arguments: nested deeper than {MAX_ARGUMENTS_DEPTH} levels",
                        f"input.{i}.arguments",
                    )
                called.add(item.call_id)
                call = {
                    "id": item.call_id,
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                if item.call_id not in called:
                    raise invalid_request(
                        f"input.{i}: function_call_output for call {item.call_id!r}, which no "
                        "earlier function_call item in input made",
                        f"input.{i}.call_id",
                    )
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": item.text}
                )
        return messages
