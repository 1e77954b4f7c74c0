"""One OpenAI request answered: admitted, given a slot, generated on a worker thread, and
returned whole or streamed as server-sent events (sse-starlette writes the frames).

A client that goes away (closes the stream, or hangs up while queued or generating) ends
its generation within a round, and its verifier session with it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from fastapi import Request, Response
from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent

from drafter.principals import PRINCIPAL, request_principal
from drafter.request_options import RequestOptions
from drafter.serve.backend import Generation, SpeculativeBackend
from drafter.serve.chat_api import ChatCompletionRequest, _Request
from drafter.serve.chat_writer import Answered
from drafter.serve.edge_request import EdgeRequest
from drafter.serve.errors import as_openai_error, invalid_request
from drafter.serve.prompts import Prompted, TextSide
from drafter.serve.slots import SlotPool
from drafter.serve.text_out import Spelled
from drafter.serve.tools import CallSniffer, parse_tool_calls, request_grammar
from drafter.serve.wire import Writer
from server.shared.protocol import Grammar
from server.shared.strict import did_you_mean

T = TypeVar("T")
# A stream reader that takes no bytes for this long is gone: its generation stops.
SEND_TIMEOUT_S = 30.0
# The end of a generation in its event queue (after every text it emitted).
_DONE = object()
# A request's prompts, made ready in the verifier's vocabulary (drafter/serve/prompts.py).
Render = Callable[[TextSide], list[Prompted]]


@dataclass(frozen=True)
class Choice:
    """One choice to generate: its index in the response, its prompt, and which of that
    prompt's n choices it is (a seed is offset by it)."""

    index: int
    prompted: Prompted
    nth: int


@dataclass
class Started:
    """A choice's generation, running on a slot; its texts arrive in `events`."""

    choice: Choice
    generation: Generation
    running: asyncio.Future
    events: asyncio.Queue

    def answered(self, text: str = "", logprobs: list[Spelled] | None = None) -> Answered:
        """The choice, once it is done (its result raises if it failed)."""
        finished = self.running.result()
        return Answered(self.choice.index, text, finished, self.choice.nth == 0, logprobs)

    def whole(self, wants_logprobs: bool, calls_tools: bool) -> Answered:
        """The choice whole, once it is done: its text (and the tool calls it makes), and
        the logprobs if asked for."""
        texts, logprobs = [self.choice.prompted.echo], []
        while (item := self.events.get_nowait()) is not _DONE:
            texts.append(item[0])
            logprobs += item[1]
        text = "".join(texts)
        text, calls = parse_tool_calls(text) if calls_tools else (text, [])
        answered = self.answered(text, logprobs if wants_logprobs else None)
        return replace(answered, tool_calls=tuple(calls))


@dataclass(frozen=True)
class Shown:
    """What a stream shows beside the text."""

    usage: bool  # a last chunk with the usage (stream_options.include_usage)
    logprobs: bool
    tool_calls: bool  # the answer may be a tool call: held while it may begin one


def calls_tools(request: _Request) -> bool:
    return isinstance(request, ChatCompletionRequest) and request.calls_tools


def check_fields(request: _Request | EdgeRequest) -> None:
    """Every field is honoured or refused: a name no API has, or one not supported here,
    is a 400 naming it."""
    unknown = request.unknown_fields()
    if unknown:
        raise invalid_request(
            f"unknown field {unknown[0]!r}" + did_you_mean(unknown[0], request.known_fields()),
            param=unknown[0],
            code="unknown_parameter",
        )
    unsupported = request.unsupported_fields()
    if unsupported:
        why = request.why_unsupported(unsupported[0])
        raise invalid_request(
            f"not supported by this server: {', '.join(unsupported)}"
            + (f" ({why})" if why else ""),
            param=unsupported[0],
            code="unsupported_parameter",
        )


async def answer(
    http: Request,
    backend: SpeculativeBackend,
    request: _Request,
    render: Render,
    max_tokens: int,
    writer: Writer,
) -> Response | BaseModel:
    """The request's response: each choice admitted, given a slot and generated, one after
    another; returned whole, or streamed, in the shapes of the API `writer` writes."""
    check_fields(request)
    try:  # a grammar of many tools' schemas takes a while to write: off the event loop
        grammar = await backend.render_gate.run(request_grammar, request)
    except Exception as exc:
        raise as_openai_error(exc) from exc
    pool, prompts = await rendered(backend, render)
    try:
        for prompted in prompts:
            backend.check_prompt(prompted.prompt_ids)
    except Exception as exc:
        raise as_openai_error(exc) from exc
    choices = [
        Choice(i * request.n + nth, prompted, nth)
        for i, prompted in enumerate(prompts)
        for nth in range(request.n)
    ]
    gone = asyncio.create_task(until_disconnected(http))
    # The key guard's (drafter/serve/access.py), or for a keyless request, where it came from.
    principal = request_principal(http.scope.get(PRINCIPAL), http.headers.get("host", ""))

    async def begin(choice: Choice) -> Started | None:
        return await begin_choice(
            backend, pool, request, choice, max_tokens, gone, grammar, principal
        )

    try:
        started = await begin(choices[0])
    except Exception as exc:
        gone.cancel()
        raise as_openai_error(exc) from exc
    except BaseException:
        gone.cancel()
        raise
    if started is None:  # the client left while queued: nobody to answer
        gone.cancel()
        return Response(status_code=499)
    if request.stream:
        shown = Shown(
            request.include_usage, request.logprobs_top() is not None, calls_tools(request)
        )
        frames = stream(writer, started, choices[1:], begin, gone, shown)
        return EventSourceResponse(frames, sep="\n", send_timeout=SEND_TIMEOUT_S)
    answered: list[Answered] = []
    try:
        while True:
            # Shielded: a cancelled request must not orphan the generation.
            await asyncio.shield(started.running)
            wants_logprobs = request.logprobs_top() is not None
            answered.append(started.whole(wants_logprobs, calls_tools(request)))
            if len(answered) == len(choices):
                return writer.whole(answered)
            started = await begin(choices[len(answered)])
            if started is None:
                return Response(status_code=499)
    except Exception as exc:
        raise as_openai_error(exc) from exc
    finally:
        if started is not None:
            started.generation.cancel.set()  # a no-op once done; stops it if cancelled
        gone.cancel()


async def count_prompt_tokens(backend: SpeculativeBackend, render: Render) -> int:
    """How many tokens the request's prompt is (`/messages/count_tokens`,
    `/responses/input_tokens`): the prompt rendered as a generation would render it."""
    _, prompts = await rendered(backend, render)
    return sum(len(p.prompt_ids) for p in prompts)


async def rendered(backend: SpeculativeBackend, render: Render) -> tuple[SlotPool, list[Prompted]]:
    """The slots, once the draft model is loaded, and the request's prompts rendered in
    its vocabulary (through the render gate: a long prompt takes a while to tokenize)."""
    try:
        pool = await backend.ready()
        side = backend.text_side(pool.slots[0].model)
        return pool, await backend.render_gate.run(render, side)
    except Exception as exc:
        raise as_openai_error(exc) from exc


async def begin_choice(
    backend: SpeculativeBackend,
    pool: SlotPool,
    request: _Request,
    choice: Choice,
    max_tokens: int,
    gone: asyncio.Task,
    grammar: Grammar | None = None,
    principal: str | None = None,
) -> Started | None:
    """The choice admitted (QueueFull at once if the queue is full), given a slot, and
    started; None if the client leaves while it waits. `principal`: whose key it came
    with, whose history and caches it may be drafted from."""
    events: asyncio.Queue = asyncio.Queue()  # (text, logprobs) pairs, then _DONE
    loop = asyncio.get_running_loop()

    def emit(text: str, spelled: list[Spelled]) -> None:
        loop.call_soon_threadsafe(events.put_nowait, (text, spelled))

    generation = Generation(
        prompt=choice.prompted.verifier_input,
        options=RequestOptions.for_request(
            request.sampling(choice.nth), max_tokens, grammar, request.logprobs_top()
        ),
        prompt_ids=choice.prompted.prompt_ids,
        stop=request.stop_list(),
        emit=emit,
        stream=bool(request.stream),
        principal=principal,
    )
    gone.add_done_callback(lambda _: generation.cancel.set())
    turn = pool.admit(generation.prompt_ids, backend.caches.of(principal))
    slot = await first_unless_gone(turn, gone, pool.release)
    if slot is None:
        return None
    running = backend.start(slot, generation)  # from here the slot is its
    running.add_done_callback(lambda _: events.put_nowait(_DONE))
    return Started(choice, generation, running, events)


async def stream(
    writer: Writer,
    started: Started | None,
    rest: list[Choice],
    begin: Callable[[Choice], Awaitable[Started | None]],
    gone: asyncio.Task,
    shown: Shown,
) -> AsyncIterator[ServerSentEvent]:
    """Each choice's events in turn, then the API's closing ones; a choice that fails, or
    cannot begin, or whose events cannot be written, is an error event (the API's) before
    them."""
    answered: list[Answered] = []
    try:
        while started is not None:
            try:
                async for event in choice_events(writer, started, shown, answered):
                    yield event
                started = await begin(rest.pop(0)) if rest else None
            except Exception as exc:
                for event in writer.failure(as_openai_error(exc)):
                    yield event
                break
        else:
            for event in writer.closing(answered, shown.usage):
                yield event
            return
        for event in writer.closing(answered, False):
            yield event
    finally:
        if started is not None:
            started.generation.cancel.set()  # a no-op once done; stops it if the client left
        gone.cancel()


async def choice_events(
    writer: Writer, started: Started, shown: Shown, answered: list[Answered]
) -> AsyncIterator[ServerSentEvent]:
    """One choice's events, as its text comes; the choice, once done, goes in `answered`."""
    index = started.choice.index
    for event in writer.opening(index, len(started.choice.prompted.prompt_ids)):
        yield event
    if echo := started.choice.prompted.echo:
        for event in writer.text(index, echo, None):
            yield event
    sniffer = CallSniffer() if shown.tool_calls else None
    while (item := await started.events.get()) is not _DONE:
        text, spelled = item
        if sniffer is not None:
            text = sniffer.feed(text)
        if text or (shown.logprobs and spelled):
            for event in writer.text(index, text, spelled if shown.logprobs else None):
                yield event
    calls: list = []
    if sniffer is not None:
        held, calls = sniffer.finish()
        if held:
            for event in writer.text(index, held, None):
                yield event
        if calls:
            for event in writer.calls(index, calls):
                yield event
    answered.append(replace(started.answered(), tool_calls=tuple(calls)))
    for event in writer.ending(answered[-1]):
        yield event


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
