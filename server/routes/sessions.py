"""Speculative rounds: open a session, verify drafts, close it."""

from fastapi import APIRouter, Request, Response, status

from server.checks import routing_header, session_id_named
from server.protocol import (
    SESSION_ID_HEADER,
    PrefillRequest,
    PrefillResponse,
    VerifyRequest,
    VerifyResponse,
)
from server.routes import model_json
from server.state import SchedulerDep, key_id

router = APIRouter(tags=["sessions"])


@router.post("/prefill", response_model=PrefillResponse)
async def prefill(request: PrefillRequest, scheduler: SchedulerDep, http: Request) -> Response:
    header = routing_header(http.headers.getlist(SESSION_ID_HEADER))
    session_id = session_id_named(header, request.session_id)
    request = request.model_copy(update={"session_id": session_id})
    return model_json(await scheduler.prefill(request, key_id(http)))


@router.post("/verify", response_model=VerifyResponse)
async def verify(request: VerifyRequest) -> Response:
    """One speculative round: the pending token and the draft decoded together, the
    longest agreeing prefix accepted, plus one token of the verifier's.

    DOCUMENTATION ONLY: `server.verify_lane.VerifierAPI` takes POST /verify off before
    routing, so this function never runs; it gives the endpoint its OpenAPI entry."""
    raise RuntimeError("POST /verify is served by server.verify_lane, not by this route")


@router.delete("/sessions/{session_id}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_session(session_id: str, scheduler: SchedulerDep, http: Request) -> None:
    session_id_named(routing_header(http.headers.getlist(SESSION_ID_HEADER)), session_id)
    engine, owner = scheduler.engine, key_id(http)
    await scheduler.call(lambda: engine.delete_session(session_id, owner), session_id)
