"""A local OpenAI-compatible server (`draft_token_generator serve`), backed by remote
verification: chat apps, editors and scripts get speculative decoding unchanged.

The draft model is loaded on the first request that finds the verifier (so the server
starts even while the verifier is down) and serves one generation at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from drafter.errors import DrafterError, VerifierRejected, VerifierUnavailable, VocabularyMismatch
from drafter.model import DraftModel
from drafter.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SpeculativeFigures,
    Usage,
)
from drafter.output import TextDecoder
from drafter.runner import RunOptions, connect, load_checked_drafter, speculative_loop
from drafter.stops import StopScanner
from server.protocol import InfoResponse, PrefillRequest, SamplingParams

log = logging.getLogger("drafter.serve")

DEFAULT_CHAT_MAX_TOKENS = 512


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, error_type: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.code = status, message, error_type, code

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


@dataclass
class Outcome:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "stop"
    figures: SpeculativeFigures | None = None
    text: list[str] = field(default_factory=list)


class SpeculativeBackend:
    def __init__(self, options: RunOptions):
        self.options = options
        # A person is waiting on the other side: fail fast rather than retry for long.
        self.client = connect(options, max_retries=1)
        self._model: DraftModel | None = None
        self._info: InfoResponse | None = None
        self.model_id = "hetero-specdecode"
        self._lock = threading.Lock()

    def close(self) -> None:
        if self._model is not None:
            self._model.close()
        self.client.close()

    def _ready(self) -> DraftModel:
        if self._model is None:
            self._model, self._info = load_checked_drafter(self.client, self.options)
            self.model_id = self._info.model
            log.info("draft model %s ready for verifier %s", self._model.name, self.options.server)
        return self._model

    def generate(
        self,
        render_prompt: Callable[[DraftModel], tuple[str, bool]],
        request: CompletionRequest | ChatCompletionRequest,
        max_tokens: int,
        emit: Callable[[str], None],
    ) -> Outcome:
        """Runs on a worker thread: one generation at a time (one draft model)."""
        with self._lock:
            model = self._ready()
            prompt, add_bos = render_prompt(model)
            sampling = SamplingParams(
                temperature=request.temperature, top_p=request.top_p, seed=request.seed
            )
            options = dataclasses.replace(self.options, prompt=prompt, sampling=sampling)
            model.reset()
            loop = speculative_loop(model, self.client, self._info, options)
            decoder = TextDecoder(model.token_bytes)
            scanner = StopScanner(request.stop_list())
            outcome = Outcome()
            rounds = loop.run(
                PrefillRequest(prompt=prompt, add_bos=add_bos, sampling=sampling), max_tokens
            )
            for event in rounds:
                text = scanner.feed(decoder.feed(event.tokens))
                if text:
                    emit(text)
                if scanner.stopped:
                    rounds.close()
                    break
            else:
                tail = scanner.feed(decoder.flush()) + scanner.flush()
                if tail:
                    emit(tail)
            result = loop.result
            stats = result.stats
            outcome.prompt_tokens = stats.prompt_tokens
            outcome.completion_tokens = len(result.tokens)
            stopped = scanner.stopped or result.finish_reason == "eos"
            outcome.finish_reason = "stop" if stopped else "length"
            outcome.figures = SpeculativeFigures(
                strategy=result.strategy,
                lossless=result.lossless,
                rounds=stats.rounds,
                drafted=stats.drafted,
                accepted=stats.accepted,
                acceptance_rate=round(stats.acceptance_rate, 4),
                tokens_per_round=round(stats.tokens_per_round, 4),
                recoveries=stats.recoveries,
            )
            log.info(
                "%d tokens in %d rounds: acceptance %.1f%%, %.2f tokens/round, %.1f tok/s",
                len(result.tokens),
                stats.rounds,
                100 * stats.acceptance_rate,
                stats.tokens_per_round,
                stats.tokens_per_s,
            )
            return outcome


def create_openai_app(options: RunOptions) -> FastAPI:
    backend = SpeculativeBackend(options)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        backend.close()

    app = FastAPI(title="hetero-specdecode local OpenAI API", lifespan=lifespan)
    app.state.backend = backend

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request"}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        error = OpenAIError(400, f"{where}: {first['msg']}", "invalid_request_error")
        return JSONResponse(error.body(), status_code=400)

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
    async def completions(request: CompletionRequest):
        def render(_: DraftModel) -> tuple[str, bool]:
            return request.prompt, True

        return await respond(request, render, request.max_tokens or 16, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest):
        messages = [
            ("system" if m.role == "developer" else m.role, m.content) for m in request.messages
        ]

        def render(model: DraftModel) -> tuple[str, bool]:
            prompt = model.render_chat(messages)
            return prompt, not model.starts_with_bos(prompt)

        max_tokens = request.max_completion_tokens or request.max_tokens
        return await respond(request, render, max_tokens or DEFAULT_CHAT_MAX_TOKENS, chat=True)

    async def respond(request, render, max_tokens: int, *, chat: bool):
        if request.n != 1:
            raise OpenAIError(400, "only n=1 is supported", "invalid_request_error")
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if request.stream:
            return StreamingResponse(
                stream(request, render, max_tokens, chat, response_id, created),
                media_type="text/event-stream",
            )
        pieces: list[str] = []
        try:
            outcome = await asyncio.to_thread(
                backend.generate, render, request, max_tokens, pieces.append
            )
        except Exception as exc:
            raise as_openai_error(exc) from exc
        text = "".join(pieces)
        choice = (
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": outcome.finish_reason,
                "logprobs": None,
            }
            if chat
            else {
                "index": 0,
                "text": text,
                "finish_reason": outcome.finish_reason,
                "logprobs": None,
            }
        )
        return {
            "id": response_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": backend.model_id,
            "choices": [choice],
            "usage": usage(outcome).model_dump(),
            "speculative": outcome.figures.model_dump(),
        }

    async def stream(request, render, max_tokens, chat, response_id, created):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(text: str) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, ("text", text))

        def work() -> None:
            try:
                outcome = backend.generate(render, request, max_tokens, emit)
                loop.call_soon_threadsafe(queue.put_nowait, ("done", outcome))
            except Exception as exc:
                loop.call_soon_threadsafe(queue.put_nowait, ("error", exc))

        def chunk(delta: str | None, finish: str | None, extra: dict | None = None) -> str:
            if chat:
                body = {"role": "assistant", "content": delta} if delta is not None else {}
                choice = {"index": 0, "delta": body, "finish_reason": finish, "logprobs": None}
            else:
                choice = {
                    "index": 0,
                    "text": delta or "",
                    "finish_reason": finish,
                    "logprobs": None,
                }
            payload = {
                "id": response_id,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": backend.model_id,
                "choices": [choice],
                **(extra or {}),
            }
            return f"data: {json.dumps(payload)}\n\n"

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        while True:
            kind, value = await queue.get()
            if kind == "text":
                yield chunk(value, None)
            elif kind == "done":
                yield chunk(
                    None if chat else "",
                    value.finish_reason,
                    {"usage": usage(value).model_dump(), "speculative": value.figures.model_dump()},
                )
                break
            else:
                yield f"data: {json.dumps(as_openai_error(value).body())}\n\n"
                break
        yield "data: [DONE]\n\n"

    return app


def usage(outcome: Outcome) -> Usage:
    return Usage(
        prompt_tokens=outcome.prompt_tokens,
        completion_tokens=outcome.completion_tokens,
        total_tokens=outcome.prompt_tokens + outcome.completion_tokens,
    )


def serve(options: RunOptions, host: str, port: int) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    log.info(
        "OpenAI-compatible API on http://%s:%d/v1, verifying at %s", host, port, options.server
    )
    uvicorn.run(create_openai_app(options), host=host, port=port, log_level="warning")
