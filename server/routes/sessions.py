"""Speculative rounds: open a session, verify drafts, close it."""

from fastapi import APIRouter, Request, Response, status

from server.protocol import PrefillRequest, PrefillResponse, VerifyRequest, VerifyResponse
from server.routes import model_json
from server.state import SchedulerDep, StateDep, key_id
from server.verify_lane import record_round, verify_round

router = APIRouter(tags=["sessions"])


@router.post("/prefill", response_model=PrefillResponse)
async def prefill(request: PrefillRequest, scheduler: SchedulerDep, http: Request) -> Response:
    return model_json(await scheduler.prefill(request, key_id(http)))


@router.post("/verify", response_model=VerifyResponse)
async def verify(request: VerifyRequest, state: StateDep, http: Request) -> Response:
    """Served by `server.verify_lane` in the running app; this route documents the
    endpoint and runs the very same round."""
    response = await verify_round(state, request, key_id(http))
    record_round(state, request, response)
    return model_json(response)


@router.delete("/sessions/{session_id}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_session(session_id: str, scheduler: SchedulerDep, http: Request) -> None:
    engine, owner = scheduler.engine, key_id(http)
    await scheduler.call(lambda: engine.delete_session(session_id, owner), session_id)
