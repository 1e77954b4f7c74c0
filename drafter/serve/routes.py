"""`serve`'s routes: thin, over drafter/serve/replies.py and the backend."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from drafter.model import DraftModel
from drafter.serve.backend import SpeculativeBackend
from drafter.serve.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from drafter.serve.replies import answer

DEFAULT_CHAT_MAX_TOKENS = 512


async def get_backend(request: Request) -> SpeculativeBackend:  # async: no thread hop
    return request.app.state.backend


BackendDep = Annotated[SpeculativeBackend, Depends(get_backend)]
router = APIRouter()


@router.get("/health")
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


@router.get("/v1/models")
async def models(backend: BackendDep) -> ModelList:
    return ModelList(data=[ModelCard(id=backend.model_id)])


@router.post("/v1/completions", response_model=Completion)
async def completions(http: Request, request: CompletionRequest, backend: BackendDep):
    def render(_: DraftModel) -> tuple[str, bool]:
        return request.prompt, True

    max_tokens = request.max_tokens or 16
    return await answer(http, backend, request, render, max_tokens, chat=False)


@router.post("/v1/chat/completions", response_model=ChatCompletion)
async def chat_completions(http: Request, request: ChatCompletionRequest, backend: BackendDep):
    messages = [("system" if m.role == "developer" else m.role, m.text) for m in request.messages]

    def render(model: DraftModel) -> tuple[str, bool]:
        prompt = model.render_chat(messages)
        return prompt, not model.starts_with_bos(prompt)

    max_tokens = request.max_completion_tokens or request.max_tokens or DEFAULT_CHAT_MAX_TOKENS
    return await answer(http, backend, request, render, max_tokens, chat=True)
