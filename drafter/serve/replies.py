"""One OpenAI request answered: admitted, given a slot, generated on a worker thread, and
returned whole or streamed as server-sent events (sse-starlette writes the frames).

A client that goes away (closes the stream, or hangs up while queued or generating) ends
its generation within a round, and its verifier session with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request, Response
from sse_starlette import EventSourceResponse, ServerSentEvent

from drafter.model import DraftModel
from drafter.serve.backend import Finished, Generation, SpeculativeBackend
from drafter.serve.errors import as_openai_error, invalid_request
from drafter.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    Delta,
    _Request,
)
from server.shared.protocol import PrefillRequest
from server.shared.strict import did_you_mean

T = TypeVar("T")
# A stream reader that takes no bytes for this long is gone: its generation stops.
SEND_TIMEOUT_S = 30.0
# The end of a generation in its event queue (after every text it emitted).
_DONE = object()
# How a request's prompt is made from the draft model: (prompt text, add BOS?).
Render = Callable[[DraftModel], tuple[str, bool]]


@dataclass(frozen=True)
class Reply:
    """The OpenAI shapes of one response: whole, or as stream chunks."""

    response_id: str
    created: int
    model: str
    chat: bool

    @classmethod
    def new(cls, model: str, chat: bool) -> Reply:
        prefix = "chatcmpl" if chat else "cmpl"
        return cls(f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time()), model, chat)

    def _ids(self) -> dict:
        return {"id": self.response_id, "created": self.created, "model": self.model}

    def whole(self, text: str, finished: Finished) -> Completion | ChatCompletion:
        extra = {"usage": finished.usage(), "speculative": finished.figures}
        if self.chat:
            choice = ChatChoice(
                message=AssistantMessage(content=text), finish_reason=finished.finish_reason
            )
            return ChatCompletion(**self._ids(), choices=[choice], **extra)
        choice = CompletionChoice(text=text, finish_reason=finished.finish_reason)
        return Completion(**self._ids(), choices=[choice], **extra)

    def chunk(self, text: str | None, finished: Finished | None = None) -> str:
        """A text chunk; the last one (`finished` given) carries the finish reason and the
        speculative figures."""
        finish = finished.finish_reason if finished is not None else None
        extra = {"speculative": finished.figures} if finished is not None else {}
        if self.chat:
            delta = Delta(role="assistant", content=text) if text is not None else Delta()
            choice = ChatChunkChoice(delta=delta, finish_reason=finish)
            body = ChatCompletionChunk(**self._ids(), choices=[choice], **extra)
        else:
            body = Completion(
                **self._ids(),
                choices=[CompletionChoice(text=text or "", finish_reason=finish)],
                **extra,
            )
        return body.model_dump_json(exclude_none=True)

    def usage_chunk(self, finished: Finished) -> str:
        """`stream_options.include_usage`: a last chunk with no choices and the usage."""
        kind = ChatCompletionChunk if self.chat else Completion
        return kind(**self._ids(), choices=[], usage=finished.usage()).model_dump_json(
            exclude_none=True
        )


async def answer(
    http: Request,
    backend: SpeculativeBackend,
    request: _Request,
    render: Render,
    max_tokens: int,
    *,
    chat: bool,
) -> Response | Completion | ChatCompletion:
    """The request's response: admitted, generated, whole or streamed."""
    unknown = request.unknown_fields()
    if unknown:
        raise invalid_request(
            f"unknown field {unknown[0]!r}" + did_you_mean(unknown[0], request.known_fields()),
            param=unknown[0],
            code="unknown_parameter",
        )
    unsupported = request.unsupported_fields()
    if unsupported:
        raise invalid_request(
            f"not supported by this server: {', '.join(unsupported)}",
            param=unsupported[0],
            code="unsupported_parameter",
        )
    try:
        pool = await backend.ready()
        model = pool.slots[0].model
        prompt, add_bos = render(model)
        # Off the event loop: a long prompt takes a while to tokenize.
        prompt_ids = await asyncio.to_thread(model.runtime.tokenize, prompt, add_special=add_bos)
        backend.check_prompt(prompt_ids)
        pool.admit()
    except Exception as exc:
        raise as_openai_error(exc) from exc
    events: asyncio.Queue = asyncio.Queue()  # texts, then _DONE
    loop = asyncio.get_running_loop()
    generation = Generation(
        prefill=PrefillRequest(prompt=prompt, add_bos=add_bos, sampling=request.sampling()),
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        stop=request.stop_list(),
        emit=lambda text: loop.call_soon_threadsafe(events.put_nowait, text),
    )
    gone = asyncio.create_task(until_disconnected(http))
    gone.add_done_callback(lambda _: generation.cancel.set())
    try:
        slot = await first_unless_gone(pool.acquire(prompt_ids), gone, pool.release)
        if slot is None:  # the client left while queued: nobody to answer
            return Response(status_code=499)
        running = backend.start(slot, generation)  # from here the slot is its
    except BaseException:
        gone.cancel()
        raise
    running.add_done_callback(lambda _: events.put_nowait(_DONE))
    reply = Reply.new(backend.model_id, chat)
    if request.stream:
        frames = stream(reply, generation, running, events, gone, request.include_usage)
        return EventSourceResponse(frames, sep="\n", send_timeout=SEND_TIMEOUT_S)
    try:
        finished = await asyncio.shield(running)  # a cancelled request must not orphan it
    except Exception as exc:
        raise as_openai_error(exc) from exc
    finally:
        generation.cancel.set()  # a no-op once done; stops it if this request is cancelled
        gone.cancel()
    pieces = []
    while (text := events.get_nowait()) is not _DONE:
        pieces.append(text)
    return reply.whole("".join(pieces), finished)


async def stream(
    reply: Reply,
    generation: Generation,
    running: asyncio.Future,
    events: asyncio.Queue,
    gone: asyncio.Task,
    include_usage: bool,
) -> AsyncIterator[ServerSentEvent]:
    try:
        while (text := await events.get()) is not _DONE:
            yield ServerSentEvent(data=reply.chunk(text))
        try:
            finished = running.result()
        except Exception as exc:
            yield ServerSentEvent(data=as_openai_error(exc).response().body.decode())
        else:
            yield ServerSentEvent(data=reply.chunk(None, finished))
            if include_usage:
                yield ServerSentEvent(data=reply.usage_chunk(finished))
        yield ServerSentEvent(data="[DONE]")
    finally:
        generation.cancel.set()  # a no-op once done; stops it if the client left
        gone.cancel()


async def until_disconnected(request: Request) -> None:
    """Returns when the client has gone (or the response is complete): uvicorn answers
    `receive` with http.disconnect then, and nothing else reads it once the body is in.
    A failure to listen counts as gone."""
    with contextlib.suppress(Exception):
        while (await request.receive())["type"] != "http.disconnect":
            pass


async def first_unless_gone(
    work: Awaitable[T], gone: asyncio.Task, undo: Callable[[T], None]
) -> T | None:
    """`work`'s result, or None if the client goes first (or this wait is cancelled, which
    raises): then `work` is cancelled, and `undo` gets its result if it finished anyway."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
    except BaseException:
        _drop(task, undo)
        raise
    _drop(task, undo)
    return None


def _drop(task: asyncio.Future, undo: Callable) -> None:
    def finished(task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is None:
            undo(task.result())

    if task.done():
        finished(task)
    else:
        task.cancel()
        task.add_done_callback(finished)
