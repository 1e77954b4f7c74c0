"""The verifier app (served by `uvicorn server.main:app`).

The lifespan starts loading the model in a thread and returns at once, so /health
answers 503 ("loading") until the engine and its batch scheduler are ready, then 200;
with VERIFIER_LISTEN_AFTER_LOAD, it waits for the model before uvicorn listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator

from fastapi import FastAPI

from server.shared.protocol import ErrorBody
from server.shared.request_body import BodyLimit
from server.shared.runtime import LlamaRuntime
from server.verifier.decoding.engine import Engine
from server.verifier.decoding.loading import check_model_file, describe_context, load
from server.verifier.edge.round_path import VerifyFastPath
from server.verifier.edge.routes import generate, service, sessions
from server.verifier.edge.security import ApiKeys, GuardMiddleware
from server.verifier.edge.state import AppState
from server.verifier.errors import install_error_handlers, send_error
from server.verifier.metrics import RequestMetricsMiddleware, VerifierMetrics
from server.verifier.scheduling.scheduler import BatchScheduler
from server.verifier.scheduling.service import VerifierService
from server.verifier.settings import VerifierSettings, get_settings

log = logging.getLogger(__name__)

# The exit status of a verifier whose model did not load (uvicorn's own for a failed start).
EXIT_MODEL_FAILED = 3
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def build_engine(settings: VerifierSettings) -> Engine:
    loaded = load(settings)
    resolved = settings.model_copy(update={"n_ctx": loaded.context.n_ctx})
    engine = Engine(loaded.runtime, resolved)
    engine.loaded = loaded
    return engine


def build_runtime(settings: VerifierSettings) -> LlamaRuntime:
    """The model loaded as the settings say, not yet probed."""
    return load(settings).runtime


def describe_ready(engine: Engine) -> str:
    report, shapes = engine.invariance, engine.shapes
    exact = (
        "exact"
        if report.batch_invariant
        else f"NOT exact (logits differ by {report.max_abs_diff:g})"
    )
    pinned = f", pinned at {shapes.pinned_width} rows a session" if shapes.pinned_width else ""
    pinned += " and every row's logits" if shapes.pinned_logits else ""
    reuse = "on" if engine.prefix_cache else "off"
    tiled = (
        f" (stretches of {engine.cuts.tile_rows} tokens or more in passes of as many rows"
        + (f"; shorter ones padded to it: {engine.cuts.pad})" if engine.cuts.pad != "off" else ")")
        if engine.cuts.tile_rows
        else ""
    )
    context = f" ({describe_context(engine.loaded.context)})" if engine.loaded else ""
    where = f" on {engine.loaded.placement.describe()}" if engine.loaded else ""
    return (
        f"verifier ready: {engine.model_name} ({engine.runtime.quantization}){where}, "
        f"{engine.n_seq} sessions of {engine.n_ctx} tokens{context}; "
        f"greedy passes {exact}{pinned}; "
        f"a pass costs {shapes.pass_cost_rows:.1f} rows; prompts in chunks of "
        f"{engine.prompt_chunk}{tiled}; prompt reuse {reuse}{listening()}"
    )


def listening() -> str:
    """Where uvicorn listens, as its command line says (best effort: for the log)."""
    host, port = uvicorn_option("--host", "127.0.0.1"), uvicorn_option("--port", "8000")
    if host is None:
        return ""
    scheme = "https" if any(a.startswith("--ssl-certfile") for a in sys.argv[1:]) else "http"
    return f"; at {scheme}://{host}:{port}"


def address_in_use() -> str | None:
    """The host:port uvicorn's command line names, if another process listens there
    (checked before the model loads: a verifier that cannot listen never says ready).
    Not checked where uvicorn binds before the app starts (--reload, --workers), or binds
    no host and port (--uds, --fd)."""
    own_socket = ("--reload", "--workers", "--uds", "--fd")
    if any(a.split("=")[0] in own_socket for a in sys.argv[1:]):
        return None
    host, port = uvicorn_option("--host", "127.0.0.1"), uvicorn_option("--port", "8000")
    if host is None or port is None or not port.isdigit():
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, int(port)))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"{host}:{port}"
    return None


def uvicorn_host() -> str | None:
    """The host uvicorn binds, from its command line; None when not run by uvicorn's CLI."""
    return uvicorn_option("--host", "127.0.0.1")


def uvicorn_option(name: str, default: str) -> str | None:
    """An option of uvicorn's command line (`--port 8000` or `--port=8000`), else its
    default; None when the process is not uvicorn's CLI serving this app."""
    args = sys.argv[1:]
    if not any("server.main:app" in a for a in args):
        return None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return default


def log_auth_state(keys: ApiKeys, admin_keys: ApiKeys) -> None:
    """How requests are authenticated, said once at start: the key counts, or a warning
    when anyone who reaches a port beyond loopback can use the verifier."""
    if keys.enabled:
        log.info("API keys: %d, admin keys: %d", len(keys), len(admin_keys))
        return
    host = uvicorn_host()
    if host is not None and host not in LOOPBACK:
        log.warning(
            "no API keys (VERIFIER_API_KEYS): anyone who reaches %s can use this verifier",
            host,
        )
    else:
        log.info("no API keys: open to whoever reaches the port (loopback here)")


async def _load_engine(state: AppState) -> None:
    settings = state.settings
    log.info("loading %s (the startup probe follows)", settings.model_path)
    try:
        engine = await asyncio.to_thread(build_engine, state.settings)
        scheduler = BatchScheduler(engine, state.metrics, settings)
        scheduler.start()
        state.service = VerifierService(scheduler)
        log.info("%s", describe_ready(engine))
    except Exception as exc:
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.error("could not load the verifier model: %s", state.load_error)
        if not settings.wait_for_model and not settings.listen_after_load:
            # Nothing to serve: end the process (uvicorn stops as on Ctrl-C, and the
            # lifespan ends it with EXIT_MODEL_FAILED) rather than answer 503 forever.
            # Listening after the load, the failed startup itself ends it.
            signal.raise_signal(signal.SIGTERM)


def create_app(settings: VerifierSettings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        show_logs_as_uvicorn_does()
        log_auth_state(keys, admin_keys)
        taken = address_in_use()
        if taken is not None:
            raise RuntimeError(f"{taken} is in use by another process: nothing can listen there")
        if not settings.wait_for_model:
            check_model_file(settings.model_path)  # uvicorn exits non-zero on this
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
            if state.service is not None:
                await asyncio.to_thread(state.service.close)
        if state.load_error and not settings.wait_for_model:
            # uvicorn ends with status 0 once it has started, whatever stopped it; a
            # verifier that never had a model failed, and says so to whoever started it.
            logging.shutdown()
            os._exit(EXIT_MODEL_FAILED)

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
    keys = ApiKeys.from_settings(settings.api_keys, settings.api_key_file)
    admin_keys = ApiKeys.from_settings(settings.admin_api_keys, None)
    app.add_middleware(GuardMiddleware, keys=keys, admin_keys=admin_keys)
    app.add_middleware(RequestMetricsMiddleware)
    return app


def show_logs_as_uvicorn_does() -> None:
    """The verifier's own log lines (loading, the probe's verdicts, ready) at the level
    and in the shape uvicorn was started with (`--log-level`)."""
    ours = logging.getLogger("server")
    if ours.handlers:
        return
    uvicorn = logging.getLogger("uvicorn.error")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    ours.addHandler(handler)
    ours.setLevel(uvicorn.getEffectiveLevel() if uvicorn.level else logging.INFO)
    ours.propagate = False


async def _reject(scope, send, status: int, code: str, message: str) -> None:
    close = [(b"connection", b"close")] if status in (408, 413) else []
    await send_error(send, status, code, message, close)
