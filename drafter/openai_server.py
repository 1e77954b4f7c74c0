"""A local OpenAI-compatible server (`draft_token_generator serve`), backed by remote
verification: chat apps, editors and scripts get speculative decoding unchanged.

The draft model is loaded on the first request that finds the verifier (so the server
starts even while the verifier is down). Up to `--parallel` generations run at once, each
on its own draft sequence and verifier connection (drafter/slots.py); more wait in a
bounded queue, and beyond it get 429. A client that goes away (closes the stream,
presses stop) ends its generation within a round, and its verifier session with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from drafter.errors import DrafterError, VerifierRejected, VerifierUnavailable, VocabularyMismatch
from drafter.model import DraftModel
from drafter.openai_protocol import ChatCompletionRequest, CompletionRequest
from drafter.runner import RunOptions
from drafter.serve_backend import Generation, Outcome, PromptTooLong, SpeculativeBackend
from drafter.slots import QueueFull
from server.protocol import PrefillRequest, SamplingParams

log = logging.getLogger("drafter.serve")

DEFAULT_CHAT_MAX_TOKENS = 512
DEFAULT_PARALLEL = 2
DEFAULT_MAX_QUEUE = 8
QUEUE_FULL_RETRY_AFTER_S = 2
# The end of a generation in its event queue (after every text it emitted).
_DONE = object()
T = TypeVar("T")


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        error_type: str,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.error_type, self.code = status, message, error_type, code
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": None,
                "code": self.code,
            }
        }


def as_openai_error(exc: Exception) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, PromptTooLong):
        return OpenAIError(400, str(exc), "invalid_request_error", "context_length_exceeded")
    if isinstance(exc, QueueFull):
        retry = {"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)}
        return OpenAIError(429, str(exc), "rate_limit_error", "queue_full", retry)
    if isinstance(exc, VocabularyMismatch):
        return OpenAIError(502, str(exc), "verifier_error", "vocabulary_mismatch")
    if isinstance(exc, VerifierUnavailable):
        return OpenAIError(503, str(exc), "verifier_error", "verifier_unavailable")
    if isinstance(exc, VerifierRejected):
        status = exc.status if exc.status in (400, 409, 503) else 502
        return OpenAIError(status, exc.message, "verifier_error", exc.error_type)
    if isinstance(exc, DrafterError):
        return OpenAIError(500, str(exc), "server_error", "drafter_error")
    log.exception("unexpected error")
    return OpenAIError(500, f"{type(exc).__name__}: {exc}", "server_error", "internal_error")


async def until_disconnected(request: Request) -> None:
    """Returns when the client has gone (or the response is complete): uvicorn answers
    `receive` with http.disconnect then, and nothing else reads it once the body is in.
    A failure to listen counts as gone."""
    with contextlib.suppress(Exception):
        while (await request.receive())["type"] != "http.disconnect":
            pass


def create_openai_app(options: RunOptions, *, parallel: int = 2, max_queue: int = 8) -> FastAPI:
    backend = SpeculativeBackend(options, parallel=parallel, max_queue=max_queue)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(backend.close)

    app = FastAPI(title="hetero-specdecode local OpenAI API", lifespan=lifespan)
    app.state.backend = backend

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request"}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        error = OpenAIError(400, f"{where}: {first['msg']}", "invalid_request_error")
        return JSONResponse(error.body(), status_code=400)

    @app.get("/health")
    async def health() -> dict:
        pool = backend.pool
        return {
            "status": "ok",
            "draft_model_loaded": pool is not None,
            "parallel": backend.parallel,
            "running": 0 if pool is None else pool.running,
            "waiting": 0 if pool is None else pool.waiting,
            "stopping": backend.stopping,
            "max_queue": backend.max_queue,
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": backend.model_id,
                    "object": "model",
                    "created": 0,
                    "owned_by": "hetero-specdecode",
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(http_request: Request, request: CompletionRequest):
        def render(_: DraftModel) -> tuple[str, bool]:
            return request.prompt, True

        max_tokens = request.max_tokens or 16
        return await respond(http_request, request, render, max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: Request, request: ChatCompletionRequest):
        messages = [
            ("system" if m.role == "developer" else m.role, m.content) for m in request.messages
        ]

        def render(model: DraftModel) -> tuple[str, bool]:
            prompt = model.render_chat(messages)
            return prompt, not model.starts_with_bos(prompt)

        max_tokens = request.max_completion_tokens or request.max_tokens
        max_tokens = max_tokens or DEFAULT_CHAT_MAX_TOKENS
        return await respond(http_request, request, render, max_tokens, chat=True)

    async def respond(http_request: Request, request, render, max_tokens: int, *, chat: bool):
        if request.n != 1:
            raise OpenAIError(400, "only n=1 is supported", "invalid_request_error")
        try:
            pool = await backend.ready()
            model = pool.slots[0].model
            prompt, add_bos = render(model)
            # Off the event loop: a long prompt takes a while to tokenize.
            prompt_ids = await asyncio.to_thread(
                model.runtime.tokenize, prompt, add_special=add_bos
            )
            backend.check_prompt(prompt_ids, max_tokens)
            pool.admit()
        except Exception as exc:
            raise as_openai_error(exc) from exc
        sampling = SamplingParams(
            temperature=request.temperature, top_p=request.top_p, seed=request.seed
        )
        events: asyncio.Queue = asyncio.Queue()  # texts, then _DONE
        loop = asyncio.get_running_loop()
        generation = Generation(
            prefill=PrefillRequest(prompt=prompt, add_bos=add_bos, sampling=sampling),
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            stop=request.stop_list(),
            emit=lambda text: loop.call_soon_threadsafe(events.put_nowait, text),
        )
        gone = asyncio.create_task(until_disconnected(http_request))
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
        reply = Reply(
            f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            int(time.time()),
            backend.model_id,
            chat,
        )
        if request.stream:
            body = stream(reply, generation, running, events, gone, request.include_usage)
            return StreamingResponse(body, media_type="text/event-stream")
        try:
            outcome = await asyncio.shield(running)  # a cancelled request must not orphan it
        except Exception as exc:
            raise as_openai_error(exc) from exc
        finally:
            generation.cancel.set()  # a no-op once done; stops it if this request is cancelled
            gone.cancel()
        pieces = []
        while (text := events.get_nowait()) is not _DONE:
            pieces.append(text)
        return reply.whole("".join(pieces), outcome)

    async def stream(
        reply: Reply,
        generation: Generation,
        running: asyncio.Future,
        events: asyncio.Queue,
        gone: asyncio.Task,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        try:
            while (text := await events.get()) is not _DONE:
                yield reply.chunk(text, None)
            try:
                outcome = running.result()
            except Exception as exc:
                yield f"data: {json.dumps(as_openai_error(exc).body())}\n\n"
            else:
                yield reply.chunk(None, outcome.finish_reason, outcome)
                if include_usage:
                    yield reply.usage_chunk(outcome)
            yield "data: [DONE]\n\n"
        finally:
            generation.cancel.set()  # a no-op once done; stops it if the client left
            gone.cancel()

    return app


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


@dataclass(frozen=True)
class Reply:
    """The OpenAI shapes of one response: whole, or as server-sent event chunks."""

    response_id: str
    created: int
    model: str
    chat: bool

    def _body(self, choices: list[dict], stream: bool, **extra) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if stream and self.chat else ""
        )
        return {
            "id": self.response_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def whole(self, text: str, outcome: Outcome) -> dict:
        choice: dict = {"index": 0, "finish_reason": outcome.finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return self._body(
            [choice],
            stream=False,
            usage=outcome.usage().model_dump(),
            speculative=outcome.figures.model_dump(),
        )

    def chunk(self, text: str | None, finish: str | None, outcome: Outcome | None = None) -> str:
        """A text chunk; the last one (`outcome` given) carries the finish reason and the
        speculative figures."""
        choice: dict = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if text is not None else {}
        else:
            choice["text"] = text or ""
        extra = {} if outcome is None else {"speculative": outcome.figures.model_dump()}
        return _event(self._body([choice], stream=True, **extra))

    def usage_chunk(self, outcome: Outcome) -> str:
        """`stream_options.include_usage`: a last chunk with no choices and the usage."""
        return _event(self._body([], stream=True, usage=outcome.usage().model_dump()))


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def serve(
    options: RunOptions,
    host: str,
    port: int,
    *,
    parallel: int = DEFAULT_PARALLEL,
    max_queue: int = DEFAULT_MAX_QUEUE,
) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    log.info(
        "OpenAI-compatible API on http://%s:%d/v1, verifying at %s", host, port, options.server
    )
    app = create_openai_app(options, parallel=parallel, max_queue=max_queue)
    uvicorn.run(app, host=host, port=port, log_level="warning")
