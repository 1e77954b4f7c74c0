"""The Responses API's shapes of one answer: the response object whole, or its stream's
events in OpenAI's order, each numbered (`sequence_number`): `response.created`,
`response.in_progress`, then a message's (`response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`..., `.done` each) where there
is text, then each function call's (`response.output_item.added`,
`response.function_call_arguments.delta` and `.done`, `response.output_item.done`), then
`response.completed` (or `response.incomplete`, cut at `max_output_tokens`)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pydantic import BaseModel
from sse_starlette import ServerSentEvent

from drafter.serve.chat_responses import SpeculativeFigures, ToolCall
from drafter.serve.chat_writer import Answered, total_figures
from drafter.serve.errors import OpenAIError
from drafter.serve.responses_api import ResponsesRequest
from drafter.serve.text_out import Spelled


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: str = "response"
    created_at: int
    status: str  # in_progress, completed, incomplete, failed
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[dict[str, Any]]
    parallel_tool_calls: bool = False
    previous_response_id: None = None
    reasoning: dict[str, None] = {"effort": None, "summary": None}
    store: bool = False
    temperature: float
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    top_p: float
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, Any] = {}
    speculative: SpeculativeFigures | None = None


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponsesWriter:
    """One response's ids and stream state (n is 1: one answer)."""

    def __init__(self, request: ResponsesRequest, model: str):
        self.request = request
        self.model = model
        self.response_id = _id("resp")
        self.created_at = int(time.time())
        self.message_id = _id("msg")
        self.sequence = 0
        self.text_so_far = ""
        self.message_open = False
        self.message_done = False

    def whole(self, answered: Sequence[Answered]) -> BaseModel:
        (one,) = answered
        return self._response(one)

    def _response(self, answered: Answered | None) -> ResponseObject:
        """The response now: in progress (no answer yet) or done."""
        request = self.request
        form = request.text.format if request.text is not None else None
        tool_choice = request.tool_choice or ("auto" if request.tools else "none")
        body: dict[str, Any] = {
            "id": self.response_id,
            "created_at": self.created_at,
            "status": "in_progress",
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": self.model,
            "output": [],
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "text": {
                "format": form.model_dump(by_alias=True, exclude_none=True)
                if form
                else {"type": "text"}
            },
            "tool_choice": tool_choice
            if isinstance(tool_choice, str)
            else tool_choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in request.tools or ()],
            "metadata": request.metadata or {},
            "parallel_tool_calls": request.parallel_tool_calls is not False,
        }
        if answered is not None:
            finished = answered.finished
            cut = finished.finish_reason == "length" and not answered.tool_calls
            body["status"] = "incomplete" if cut else "completed"
            if cut:
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            calls = answered.tool_calls
            message = [self._message_item(answered.text, "completed")]
            body["output"] = [
                *(message if answered.text or not calls else []),
                *(self._call_item(call) for call in calls),
            ]
            body["usage"] = ResponseUsage(
                input_tokens=finished.prompt_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=finished.cached_tokens),
                output_tokens=finished.completion_tokens,
                total_tokens=finished.prompt_tokens + finished.completion_tokens,
            )
            body["speculative"] = total_figures([answered])
        return ResponseObject(**body)

    def _message_item(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [_output_text(text)]
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    @staticmethod
    def _call_item(call: ToolCall, arguments: str | None = None, status: str = "completed"):
        return {
            "type": "function_call",
            "id": "fc_" + call.id.removeprefix("call_"),
            "call_id": call.id,
            "name": call.function.name,
            "arguments": call.function.arguments if arguments is None else arguments,
            "status": status,
        }

    def _event(self, kind: str, **fields: Any) -> ServerSentEvent:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return ServerSentEvent(event=kind, data=json.dumps(body))

    def _response_event(self, kind: str, answered: Answered | None) -> ServerSentEvent:
        return self._event(kind, response=self._response(answered).model_dump(mode="json"))

    def opening(self, index: int, prompt_tokens: int) -> list[ServerSentEvent]:
        return [
            self._response_event("response.created", None),
            self._response_event("response.in_progress", None),
        ]

    def _open_message(self) -> list[ServerSentEvent]:
        if self.message_open:
            return []
        self.message_open = True
        at = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return [
            self._event(
                "response.output_item.added",
                output_index=0,
                item=self._message_item(None, "in_progress"),
            ),
            self._event("response.content_part.added", **at, part=_output_text("")),
        ]

    def text(self, index: int, text: str, logprobs: list[Spelled] | None) -> list[ServerSentEvent]:
        if not text:
            return []
        opened = self._open_message()
        self.text_so_far += text
        at = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return [*opened, self._event("response.output_text.delta", **at, delta=text, logprobs=[])]

    def _close_message(self) -> list[ServerSentEvent]:
        if self.message_done:
            return []
        self.message_done = True
        at = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        text = self.text_so_far
        return [
            self._event("response.output_text.done", **at, text=text, logprobs=[]),
            self._event("response.content_part.done", **at, part=_output_text(text)),
            self._event(
                "response.output_item.done",
                output_index=0,
                item=self._message_item(text, "completed"),
            ),
        ]

    def calls(self, index: int, calls: Sequence[ToolCall]) -> list[ServerSentEvent]:
        """Each call an output item of its own, after the message (where there is text)."""
        events = self._close_message() if self.message_open else []
        first = 1 if self.message_open else 0
        for at, call in enumerate(calls, start=first):
            item = self._call_item(call)
            arguments = call.function.arguments
            events += [
                self._event(
                    "response.output_item.added",
                    output_index=at,
                    item=self._call_item(call, "", "in_progress"),
                ),
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=at,
                    delta=arguments,
                ),
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=at,
                    name=call.function.name,
                    arguments=arguments,
                ),
                self._event("response.output_item.done", output_index=at, item=item),
            ]
        return events

    def ending(self, answered: Answered) -> list[ServerSentEvent]:
        events = []
        if not answered.tool_calls:
            events += [*self._open_message(), *self._close_message()]
        done = self._response(replace(answered, text=self.text_so_far))
        kind = "response.incomplete" if done.status == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=done.model_dump(mode="json"))]

    def closing(self, answered: Sequence[Answered], usage: bool) -> list[ServerSentEvent]:
        return []

    def failure(self, error: OpenAIError) -> list[ServerSentEvent]:
        """An `error` event, then the response failed (as OpenAI ends such a stream)."""
        failed = self._response(None).model_copy(
            update={"status": "failed", "error": {"code": error.code, "message": error.message}}
        )
        return [
            self._event("error", code=error.code, message=error.message, param=error.param),
            self._event("response.failed", response=failed.model_dump(mode="json")),
        ]


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
