"""Health, model facts and metrics."""

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from server.protocol import HealthResponse, InfoResponse
from server.state import SchedulerDep, StateDep

router = APIRouter(tags=["service"])


@router.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
async def health(state: StateDep) -> JSONResponse:
    # Never waits for the engine: it answers while a long prefill runs (at most a lone
    # round decoded inline, see server/scheduler.py, holds it up).
    if state.scheduler is not None:
        return JSONResponse(HealthResponse(status="ok").model_dump(exclude_none=True))
    body = (
        HealthResponse(status="error", detail=state.load_error)
        if state.load_error
        else HealthResponse(status="loading")
    )
    return JSONResponse(body.model_dump(exclude_none=True), status_code=503)


@router.get("/info", response_model=InfoResponse)
async def info(scheduler: SchedulerDep) -> InfoResponse:
    return scheduler.engine.info()


@router.get("/metrics", response_class=Response)
async def metrics(state: StateDep) -> Response:
    if state.engine is not None:
        state.metrics.active_sessions.set(state.engine.session_count)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
