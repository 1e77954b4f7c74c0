"""A local OpenAI-compatible server (`draft_token_generator serve`), backed by remote
verification: chat apps, editors and scripts get speculative decoding unchanged.

The draft model is loaded at start where the verifier answers then (so that the first
request does not wait for it), else on the first request that finds the verifier (so the
server starts even while the verifier is down). Up to `--parallel` generations run at once, each
on its own draft sequence and verifier connection (drafter/serve/slots.py); more wait in
a bounded queue, and beyond it get 429. Bodies are capped in size (at most what a request
could use with the verifier's context: drafter/serve/body_bounds.py) and in the time they
take to arrive, like the verifier's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from drafter.serve.access import add_access
from drafter.serve.backend import SpeculativeBackend
from drafter.serve.errors import install_error_handlers, send_openai_error
from drafter.serve.routes import health_router, router
from drafter.settings import DrafterSettings
from server.shared.request_body import BodyLimit

log = logging.getLogger("drafter.serve")

BODY_TIMEOUT_S = 30.0


def create_app(settings: DrafterSettings) -> FastAPI:
    backend = SpeculativeBackend(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        preload = asyncio.create_task(backend.preload())
        try:
            yield
        finally:
            # A load under way runs on a thread: over before the model is freed.
            with contextlib.suppress(Exception):
                await preload
            await asyncio.to_thread(backend.close)

    app = FastAPI(title="hetero-specdecode local OpenAI API", lifespan=lifespan)
    app.state.backend = backend
    install_error_handlers(app)
    app.include_router(health_router)
    app.include_router(router, prefix="/v1")
    app.include_router(router, include_in_schema=False)  # the paths local servers also take
    app.add_middleware(
        BodyLimit,
        max_bytes=backend.body_bounds,
        timeout_s=BODY_TIMEOUT_S,
        reject=send_openai_error,
    )
    # Outside the body limit: an unknown caller is refused before its body is read; and
    # outside that, CORS, so that a browser can read even a refusal.
    add_access(app, settings)
    return app


def serve(settings: DrafterSettings) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    log.info(
        "OpenAI-compatible API on http://%s:%d/v1, verifying at %s",
        settings.host,
        settings.port,
        settings.server,
    )
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning")
