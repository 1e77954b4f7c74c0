"""The verifier app: `uvicorn server.main:app`.

The lifespan starts loading the model on the worker thread and returns at once, so
/health answers 503 ("loading") until the engine is ready, then 200.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request

from server.engine import Engine
from server.errors import install_error_handlers
from server.protocol import ErrorBody
from server.routes import generate, service, sessions
from server.runtime import LlamaRuntime
from server.settings import VerifierSettings, get_settings
from server.state import AppState

log = logging.getLogger("server")


def build_engine(settings: VerifierSettings) -> Engine:
    runtime = LlamaRuntime(
        settings.model_path,
        n_ctx_per_seq=settings.n_ctx,
        n_seq_max=settings.max_sessions,
        n_batch=settings.n_batch,
        n_threads=settings.n_threads,
        n_gpu_layers=settings.n_gpu_layers,
        flash_attn=settings.flash_attn,
        verbose=settings.verbose,
    )
    return Engine(runtime, max_draft=settings.max_draft)


async def _load_engine(state: AppState) -> None:
    try:
        state.engine = await state.worker.run(build_engine, state.settings)
        log.info("verifier ready: %s", state.settings.model_path)
    except Exception as exc:
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.error("could not load the verifier model: %s", state.load_error)


def _endpoint_label(request: Request) -> str:
    # The router records the matched route in the scope: label by its path template, so
    # session ids never become label values.
    route = request.scope.get("route")
    return getattr(route, "path", None) or "unmatched"


def create_app(settings: VerifierSettings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = AppState(settings=settings)
        app.state.verifier = state
        loading = asyncio.create_task(_load_engine(state))
        try:
            yield
        finally:
            await loading
            if state.engine is not None:
                await state.worker.run(state.engine.close)
            state.worker.shutdown()

    app = FastAPI(
        title="hetero-specdecode verifier",
        version="0.1.0",
        lifespan=lifespan,
        responses={
            400: {"model": ErrorBody},
            404: {"model": ErrorBody},
            409: {"model": ErrorBody},
            422: {"model": ErrorBody},
            503: {"model": ErrorBody},
        },
    )
    install_error_handlers(app)
    for module in (sessions, generate, service):
        app.include_router(module.router)

    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        response = await call_next(request)
        state: AppState | None = getattr(request.app.state, "verifier", None)
        if state is not None:
            state.metrics.requests.labels(_endpoint_label(request), str(response.status_code)).inc()
        return response

    return app


app = create_app()
