"""The Messages API's shapes of one answer: the message whole, or its stream's events in
Anthropic's order (`message_start`, each content block's `content_block_start`,
`content_block_delta`s (`text_delta`, or a call's `input_json_delta`) and
`content_block_stop`: the text's where there is text, then each call's; then
`message_delta` with the `stop_reason`, then `message_stop`),
and errors in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pydantic import BaseModel
from sse_starlette import ServerSentEvent

from drafter.serve.chat_responses import SpeculativeFigures, ToolCall
from drafter.serve.chat_writer import Answered, total_figures
from drafter.serve.errors import OpenAIError, anthropic_error
from drafter.serve.text_out import Spelled


class MessageUsage(BaseModel):
    input_tokens: int  # not counting those read from the verifier's cache
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessageObject(BaseModel):
    id: str
    type: str = "message"
    role: str = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage
    speculative: SpeculativeFigures | None = None


def stop_reason(answered: Answered) -> str:
    if answered.tool_calls:
        return "tool_use"
    if answered.finished.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if answered.finished.stop_sequence is not None else "end_turn"


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": "toolu_" + call.id.removeprefix("call_"),
        "name": call.function.name,
        "input": json.loads(call.function.arguments),
    }


def _usage(answered: Answered) -> MessageUsage:
    finished = answered.finished
    return MessageUsage(
        input_tokens=finished.prompt_tokens - finished.cached_tokens,
        output_tokens=finished.completion_tokens,
        cache_read_input_tokens=finished.cached_tokens,
    )


class MessagesWriter:
    """One message's id and stream state (one answer a request)."""

    def __init__(self, model: str):
        self.model = model
        self.message_id = f"msg_{uuid.uuid4().hex[:24]}"
        self.text_so_far = ""
        self.block_open = False
        self.block_done = False

    def _message(self, answered: Answered) -> MessageObject:
        calls = answered.tool_calls
        text = [{"type": "text", "text": answered.text}] if answered.text or not calls else []
        content = [*text, *(_tool_use(call) for call in calls)]
        return MessageObject(
            id=self.message_id,
            model=self.model,
            content=content,
            stop_reason=stop_reason(answered),
            stop_sequence=answered.finished.stop_sequence,
            usage=_usage(answered),
            speculative=total_figures([answered]),
        )

    def whole(self, answered: Sequence[Answered]) -> BaseModel:
        (one,) = answered
        return self._message(one)

    @staticmethod
    def _event(kind: str, **fields: Any) -> ServerSentEvent:
        return ServerSentEvent(event=kind, data=json.dumps({"type": kind, **fields}))

    def opening(self, index: int, prompt_tokens: int) -> list[ServerSentEvent]:
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        }
        return [self._event("message_start", message=message)]

    def _open_text(self) -> list[ServerSentEvent]:
        if self.block_open:
            return []
        self.block_open = True
        block = {"type": "text", "text": ""}
        return [self._event("content_block_start", index=0, content_block=block)]

    def text(self, index: int, text: str, logprobs: list[Spelled] | None) -> list[ServerSentEvent]:
        if not text:
            return []
        opened = self._open_text()
        self.text_so_far += text
        delta = {"type": "text_delta", "text": text}
        return [*opened, self._event("content_block_delta", index=0, delta=delta)]

    def _close_text(self) -> list[ServerSentEvent]:
        if self.block_done:
            return []
        self.block_done = True
        return [self._event("content_block_stop", index=0)]

    def calls(self, index: int, calls: Sequence[ToolCall]) -> list[ServerSentEvent]:
        """Each call a `tool_use` block of its own, after the text's (where there is text)."""
        events = self._close_text() if self.block_open else []
        first = 1 if self.block_open else 0
        for at, call in enumerate(calls, start=first):
            block = {**_tool_use(call), "input": {}}
            delta = {"type": "input_json_delta", "partial_json": call.function.arguments}
            events += [
                self._event("content_block_start", index=at, content_block=block),
                self._event("content_block_delta", index=at, delta=delta),
                self._event("content_block_stop", index=at),
            ]
        return events

    def ending(self, answered: Answered) -> list[ServerSentEvent]:
        events = []
        if not answered.tool_calls:
            events += [*self._open_text(), *self._close_text()]
        done = self._message(replace(answered, text=self.text_so_far))
        delta = {"stop_reason": done.stop_reason, "stop_sequence": done.stop_sequence}
        usage = done.usage.model_dump()
        extra = {"speculative": done.speculative.model_dump()} if done.speculative else {}
        return [
            *events,
            self._event("message_delta", delta=delta, usage=usage, **extra),
            self._event("message_stop"),
        ]

    def closing(self, answered: Sequence[Answered], usage: bool) -> list[ServerSentEvent]:
        return []

    def failure(self, error: OpenAIError) -> list[ServerSentEvent]:
        body = anthropic_error(error.status, error.message)
        return [ServerSentEvent(event="error", data=json.dumps(body))]
