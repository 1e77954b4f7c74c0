"""The OpenAI shapes of one response, whole or as stream chunks, as OpenAI sends them: a
chat stream opens each choice with its role and no text, every chunk before a choice's
last says `finish_reason: null`, and every body carries the same `system_fingerprint`."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from sse_starlette import ServerSentEvent

from drafter.serve.backend import Finished
from drafter.serve.chat_responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Delta,
    SpeculativeFigures,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from drafter.serve.errors import OpenAIError
from drafter.serve.text_out import Spelled


@dataclass(frozen=True)
class Answered:
    """One choice, done."""

    index: int
    text: str
    finished: Finished
    first_of_its_prompt: bool  # its prompt is counted in the usage once
    logprobs: list[Spelled] | None = None
    tool_calls: tuple[ToolCall, ...] = ()  # the calls the answer makes, after its text

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_calls else self.finished.finish_reason


def total_usage(answered: Sequence[Answered]) -> Usage:
    """Each prompt once (however many choices it had), every choice's tokens."""
    prompts = [a.finished for a in answered if a.first_of_its_prompt]
    prompt_tokens = sum(f.prompt_tokens for f in prompts)
    completion_tokens = sum(a.finished.completion_tokens for a in answered)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details={"cached_tokens": sum(f.cached_tokens for f in prompts)},
    )


def total_figures(answered: Sequence[Answered]) -> SpeculativeFigures | None:
    """The speculative figures of every choice together."""
    figures = [a.finished.figures for a in answered if a.finished.figures is not None]
    if len(figures) <= 1:
        return figures[0] if figures else None
    rounds = sum(f.rounds for f in figures)
    drafted = sum(f.drafted for f in figures)
    accepted = sum(f.accepted for f in figures)
    tokens = sum(a.finished.completion_tokens for a in answered)
    return figures[0].model_copy(
        update={
            "rounds": rounds,
            "drafted": drafted,
            "accepted": accepted,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "tokens_per_round": round(tokens / rounds, 4) if rounds else 0.0,
            "recoveries": sum(f.recoveries for f in figures),
            "draft_cached_tokens": sum(f.draft_cached_tokens for f in figures),
        }
    )


def chat_logprobs(spelled: list[Spelled] | None) -> ChatLogprobs | None:
    if spelled is None:
        return None
    content = [
        TokenLogprob(
            token=s.token,
            logprob=s.logprob,
            bytes=list(s.raw),
            top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(b)) for t, b, lp in s.top],
        )
        for s in spelled
    ]
    return ChatLogprobs(content=content)


def completion_logprobs(spelled: list[Spelled] | None) -> CompletionLogprobs | None:
    if spelled is None:
        return None
    return CompletionLogprobs(
        tokens=[s.token for s in spelled],
        token_logprobs=[s.logprob for s in spelled],
        top_logprobs=[{t: lp for t, _, lp in s.top} for s in spelled],
        text_offset=[s.offset for s in spelled],
    )


@dataclass(frozen=True)
class Reply:
    response_id: str
    created: int
    model: str
    system_fingerprint: str
    chat: bool

    @classmethod
    def new(cls, model: str, system_fingerprint: str, chat: bool) -> Reply:
        prefix = "chatcmpl" if chat else "cmpl"
        response_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        return cls(response_id, int(time.time()), model, system_fingerprint, chat)

    def _ids(self) -> dict:
        return {
            "id": self.response_id,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
        }

    def whole(self, answered: Sequence[Answered]) -> Completion | ChatCompletion:
        extra = {"usage": total_usage(answered), "speculative": total_figures(answered)}
        if self.chat:
            chat_choices = [
                ChatChoice(
                    index=a.index,
                    message=AssistantMessage(
                        content=None if a.tool_calls and not a.text else a.text,
                        tool_calls=list(a.tool_calls) or None,
                    ),
                    finish_reason=a.finish_reason,
                    logprobs=chat_logprobs(a.logprobs),
                )
                for a in answered
            ]
            return ChatCompletion(**self._ids(), choices=chat_choices, **extra)
        choices = [
            CompletionChoice(
                index=a.index,
                text=a.text,
                finish_reason=a.finished.finish_reason,
                logprobs=completion_logprobs(a.logprobs),
            )
            for a in answered
        ]
        return Completion(**self._ids(), choices=choices, **extra)

    def opening(self, index: int, prompt_tokens: int) -> list[ServerSentEvent]:
        """What a chat stream's choice opens with: the role, no text yet."""
        if not self.chat:
            return []
        delta = Delta(role="assistant", content="")
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=None)
        return [_event(ChatCompletionChunk(**self._ids(), choices=[choice]).model_dump_json())]

    def text(self, index: int, text: str, logprobs: list[Spelled] | None) -> list[ServerSentEvent]:
        return [_event(self.chunk(index, text, logprobs=logprobs))]

    def calls(self, index: int, calls: Sequence[ToolCall]) -> list[ServerSentEvent]:
        return [_event(self.call_chunk(index, i, call)) for i, call in enumerate(calls)]

    def ending(self, answered: Answered) -> list[ServerSentEvent]:
        last = self.chunk(answered.index, None, answered.finished, calls=bool(answered.tool_calls))
        return [_event(last)]

    def closing(self, answered: Sequence[Answered], usage: bool) -> list[ServerSentEvent]:
        usage_chunk = [_event(self.usage_chunk(answered))] if usage else []
        return [*usage_chunk, _event("[DONE]")]

    def failure(self, error: OpenAIError) -> list[ServerSentEvent]:
        return [_event(json.dumps(error.body()))]

    def chunk(
        self,
        index: int,
        text: str | None,
        finished: Finished | None = None,
        logprobs: list[Spelled] | None = None,
        calls: bool = False,
    ) -> str:
        """A text chunk (`finish_reason` null), with its tokens' logprobs if asked for; a
        choice's last (`finished` given) carries no text, the finish reason and the
        choice's speculative figures."""
        finish = finished.finish_reason if finished is not None else None
        if finished is not None and calls:
            finish = "tool_calls"
        extra = {"speculative": finished.figures} if finished is not None else {}
        if self.chat:
            choice = ChatChunkChoice(
                index=index,
                delta=Delta(content=text),
                finish_reason=finish,
                logprobs=chat_logprobs(logprobs),
            )
            body = ChatCompletionChunk(**self._ids(), choices=[choice], **extra)
        else:
            text_choice = CompletionChoice(
                index=index,
                text=text or "",
                finish_reason=finish,
                logprobs=completion_logprobs(logprobs),
            )
            body = Completion(**self._ids(), choices=[text_choice], **extra)
        return body.model_dump_json()

    def call_chunk(self, index: int, position: int, call: ToolCall) -> str:
        """A chat stream's tool call, whole, as OpenAI's deltas carry one (`position`: its
        place among the choice's calls)."""
        delta = Delta(tool_calls=[ToolCallDelta(index=position, **call.model_dump())])
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=None)
        return ChatCompletionChunk(**self._ids(), choices=[choice]).model_dump_json()

    def usage_chunk(self, answered: Sequence[Answered]) -> str:
        """`stream_options.include_usage`: a last chunk with no choices and the usage."""
        kind = ChatCompletionChunk if self.chat else Completion
        usage = total_usage(answered)
        return kind(**self._ids(), choices=[], usage=usage).model_dump_json()


def _event(data: str) -> ServerSentEvent:
    return ServerSentEvent(data=data)
