"""The verifier app (served by `uvicorn server.main:app`).

The lifespan starts loading the model in a thread and returns at once, so /health
answers 503 ("loading") until the engine and its batch scheduler are ready, then 200;
with VERIFIER_LISTEN_AFTER_LOAD, it waits for the model before uvicorn listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from server.shared.protocol import ErrorBody
from server.shared.request_body import BodyLimit
from server.shared.runtime import LlamaRuntime
from server.verifier.engine import Engine
from server.verifier.errors import install_error_handlers, send_error
from server.verifier.metrics import RequestMetricsMiddleware, VerifierMetrics
from server.verifier.round_path import VerifyFastPath
from server.verifier.routes import generate, service, sessions
from server.verifier.scheduler import BatchScheduler
from server.verifier.security import ApiKeys, GuardMiddleware
from server.verifier.settings import VerifierSettings, get_settings
from server.verifier.state import AppState

log = logging.getLogger("server")


def build_engine(settings: VerifierSettings) -> Engine:
    # Each sequence has room past its context for the widest pass (a padded round, filler
    # rows), and one llama_decode holds a pass of every sequence at that width.
    widest = max(settings.max_draft + 1, settings.pin_width)
    runtime = LlamaRuntime(
        settings.model_path,
        n_ctx_per_seq=settings.n_ctx + widest,
        n_seq_max=settings.max_sessions,
        n_batch=max(settings.n_batch, settings.max_sessions * widest),
        n_threads=settings.n_threads,
        n_gpu_layers=settings.n_gpu_layers,
        flash_attn=settings.flash_attn,
        verbose=settings.verbose,
    )
    return Engine(
        runtime,
        max_draft=settings.max_draft,
        n_ctx=settings.n_ctx,
        prefix_cache_min_tokens=settings.prefix_cache_min_tokens if settings.prefix_cache else 0,
        prompt_chunk=settings.prompt_chunk,
        pin_shapes=settings.pin_shapes,
        pin_width=settings.pin_width,
        pass_cost_rows=settings.pass_cost_rows,
        key_share=settings.key_share,
    )


async def _load_engine(state: AppState) -> None:
    try:
        engine = await asyncio.to_thread(build_engine, state.settings)
        state.scheduler = BatchScheduler(
            engine,
            state.metrics,
            max_queue=state.settings.max_queue,
            session_ttl_s=state.settings.session_ttl_s,
            prefix_ttl_s=state.settings.prefix_ttl_s,
            inline_rounds=state.settings.inline_rounds,
        )
        state.engine = engine
        log.info("verifier ready: %s", state.settings.model_path)
    except Exception as exc:
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.error("could not load the verifier model: %s", state.load_error)


def create_app(settings: VerifierSettings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = VerifierMetrics(settings.max_sessions, settings.max_draft)
        state = AppState(settings=settings, metrics=metrics)
        app.state.verifier = state
        loading = asyncio.create_task(_load_engine(state))
        if settings.listen_after_load:
            # uvicorn binds its socket only after this startup: until the model is
            # ready, connections are refused, which a passive balancer understands.
            await loading
            if state.load_error:
                raise RuntimeError(f"the verifier model did not load: {state.load_error}")
        try:
            yield
        finally:
            await loading
            if state.scheduler is not None:
                await asyncio.to_thread(state.scheduler.close)

    app = FastAPI(
        title="hetero-specdecode verifier",
        version="0.1.0",
        lifespan=lifespan,
        responses={
            400: {"model": ErrorBody},
            401: {"model": ErrorBody},
            404: {"model": ErrorBody},
            403: {"model": ErrorBody},
            408: {"model": ErrorBody},
            409: {"model": ErrorBody},
            413: {"model": ErrorBody},
            422: {"model": ErrorBody},
            503: {"model": ErrorBody},
        },
    )
    install_error_handlers(app)
    for module in (sessions, generate, service):
        app.include_router(module.router)
    # The last added runs first: every request is counted, then its key checked, then its
    # body read whole (within the size and time limits), then routed (POST /verify first).
    if settings.verify_fast_path:
        app.add_middleware(VerifyFastPath)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        timeout_s=settings.body_timeout_s,
        reject=_reject,
    )
    app.add_middleware(
        GuardMiddleware,
        keys=ApiKeys.from_settings(settings.api_keys, settings.api_key_file),
        admin_keys=ApiKeys.from_settings(settings.admin_api_keys, None),
    )
    app.add_middleware(RequestMetricsMiddleware)
    return app


async def _reject(send, status: int, code: str, message: str) -> None:
    close = [(b"connection", b"close")] if status in (408, 413) else []
    await send_error(send, status, code, message, close)
