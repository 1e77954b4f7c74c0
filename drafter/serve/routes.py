"""`serve`'s routes: thin, over drafter/serve/replies.py and the backend."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from drafter.serve.backend import SpeculativeBackend
from drafter.serve.body_bounds import parse_body
from drafter.serve.chat_api import ChatCompletionRequest, CompletionRequest
from drafter.serve.chat_responses import ChatCompletion, Completion, ModelCard, ModelList
from drafter.serve.chat_writer import Reply
from drafter.serve.messages_api import CountTokensRequest, MessagesRequest
from drafter.serve.messages_writer import MessagesWriter
from drafter.serve.prompts import Prompted, TextSide, chat_prompts, completion_prompts
from drafter.serve.replies import answer, check_fields, count_prompt_tokens
from drafter.serve.responses_api import ResponsesRequest
from drafter.serve.responses_writer import ResponsesWriter


async def get_backend(request: Request) -> SpeculativeBackend:  # async: no thread hop
    return request.app.state.backend


class _ReadJSON(Request):
    def __init__(self, request: Request, validate: Callable[[Any], Any]):
        super().__init__(request.scope, request.receive)
        self.validate = validate

    async def json(self) -> Any:
        return await parse_body(
            await self.body(), self.app.state.backend.render_gate, self.validate
        )


class JSONRoute(APIRoute):
    """A route whose JSON body is read by `read_json` and validated where it was read (a
    large one off the event loop: drafter/serve/body_bounds.py): text that is not Unicode
    (a lone surrogate anywhere in it, in a schema as in a message) is refused, its field
    named (drafter/serve/errors.py), before any work."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()
        field = self.body_field

        def validate(value: Any) -> Any:
            """The body as FastAPI validates it, by its own field: the same request, the
            same errors. FastAPI then meets the request made and takes it as it is
            (pydantic runs only the model's own after and wrap validators on an instance)."""
            if field is None:
                return value
            request, errors = field.validate(value, {}, loc=("body",))
            if errors:
                # FastAPI answers what json() raises with a bare 400 whose cause this is,
                # answered as its own validation errors are (drafter/serve/errors.py).
                raise RequestValidationError(errors, body=value)
            return request

        async def handler(request: Request) -> Response:
            return await handle(_ReadJSON(request, validate))

        return handler


BackendDep = Annotated[SpeculativeBackend, Depends(get_backend)]
health_router = APIRouter(route_class=JSONRoute)
router = APIRouter(route_class=JSONRoute)  # OpenAI's routes, under /v1 and without it


@health_router.get("/health")
async def health(backend: BackendDep) -> JSONResponse:
    """200 while the verifier answers, 503 with the reason when it does not."""
    verifier = await asyncio.to_thread(backend.verifier_health)
    pool = backend.pool
    body = {
        "status": "ok" if verifier == "ok" else "unavailable",
        "verifier": verifier,
        "draft_model_loaded": pool is not None,
        "parallel": backend.settings.parallel,
        "running": 0 if pool is None else pool.running,
        "waiting": 0 if pool is None else pool.waiting,
        "stopping": backend.n_stopping,
        "max_queue": backend.settings.queue,
    }
    return JSONResponse(body, status_code=200 if verifier == "ok" else 503)


@router.get("/models")
async def models(backend: BackendDep) -> ModelList:
    return ModelList(data=[ModelCard(id=backend.model_id)])


@router.post("/completions", response_model=Completion)
async def completions(http: Request, request: CompletionRequest, backend: BackendDep):
    def render(side: TextSide) -> list[Prompted]:
        assert backend.info is not None  # loaded before any prompt is rendered
        return completion_prompts(side, request, backend.info.n_vocab)

    max_tokens = request.max_tokens or 16
    writer = Reply.new(backend.model_id, backend.system_fingerprint, chat=False)
    return await answer(http, backend, request, render, max_tokens, writer)


@router.post("/chat/completions", response_model=ChatCompletion)
async def chat_completions(http: Request, request: ChatCompletionRequest, backend: BackendDep):
    def render(side: TextSide) -> list[Prompted]:
        return chat_prompts(side, request)

    limit = request.max_completion_tokens or request.max_tokens
    max_tokens = limit or backend.settings.max_output_tokens
    writer = Reply.new(backend.model_id, backend.system_fingerprint, chat=True)
    return await answer(http, backend, request, render, max_tokens, writer)


@router.post("/responses")
async def responses(http: Request, request: ResponsesRequest, backend: BackendDep):
    """OpenAI's Responses API, stateless (drafter/serve/responses_api.py)."""
    check_fields(request)
    chat = request.to_chat()

    def render(side: TextSide) -> list[Prompted]:
        return chat_prompts(side, chat)

    max_tokens = request.max_output_tokens or backend.settings.max_output_tokens
    writer = ResponsesWriter(request, backend.model_id)
    return await answer(http, backend, chat, render, max_tokens, writer)


@router.post("/responses/input_tokens")
async def response_input_tokens(request: ResponsesRequest, backend: BackendDep) -> dict:
    check_fields(request)
    chat = request.to_chat()
    tokens = await count_prompt_tokens(backend, lambda side: chat_prompts(side, chat))
    return {"object": "response.input_tokens", "input_tokens": tokens}


@router.post("/messages")
async def messages(http: Request, request: MessagesRequest, backend: BackendDep):
    """Anthropic's Messages API (drafter/serve/messages_api.py)."""
    check_fields(request)
    chat, prefill = request.to_chat(), request.prefill()

    def render(side: TextSide) -> list[Prompted]:
        return chat_prompts(side, chat, prefill)

    writer = MessagesWriter(backend.model_id)
    return await answer(http, backend, chat, render, request.max_tokens, writer)


@router.post("/messages/count_tokens")
async def count_message_tokens(request: CountTokensRequest, backend: BackendDep) -> dict:
    check_fields(request)
    chat, prefill = request.to_chat(), request.prefill()
    tokens = await count_prompt_tokens(backend, lambda side: chat_prompts(side, chat, prefill))
    return {"input_tokens": tokens}
