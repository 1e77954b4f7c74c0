"""What each API `serve` speaks writes (chat completions and completions, Responses,
Messages): one generation underneath (drafter/serve/replies.py), and a writer for each request
that turns its choices into the API's whole body or its stream's events."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pydantic import BaseModel
from sse_starlette import ServerSentEvent

from drafter.serve.chat_responses import ToolCall
from drafter.serve.chat_writer import Answered
from drafter.serve.errors import OpenAIError
from drafter.serve.text_out import Spelled


class Writer(Protocol):
    def whole(self, answered: Sequence[Answered]) -> BaseModel:
        """The response of a request not streamed, every choice done."""
        ...

    def opening(self, index: int, prompt_tokens: int) -> list[ServerSentEvent]:
        """What a choice's stream begins with, before any text."""
        ...

    def text(self, index: int, text: str, logprobs: list[Spelled] | None) -> list[ServerSentEvent]:
        """Text as it comes (with its tokens' logprobs where asked for)."""
        ...

    def calls(self, index: int, calls: Sequence[ToolCall]) -> list[ServerSentEvent]:
        """The tool calls a choice's answer makes, after its text, each whole (they are
        held until complete)."""
        ...

    def ending(self, answered: Answered) -> list[ServerSentEvent]:
        """A choice done: its finish reason and figures."""
        ...

    def closing(self, answered: Sequence[Answered], usage: bool) -> list[ServerSentEvent]:
        """After the last choice (`usage`: the client asked for a usage chunk)."""
        ...

    def failure(self, error: OpenAIError) -> list[ServerSentEvent]:
        """A choice that failed mid-stream, as the API says so."""
        ...
