"""Speculative rounds: open a session, verify drafts, close it."""

from fastapi import APIRouter, Request, Response, status
from starlette.background import BackgroundTask

from server.shared.protocol import (
    SESSION_ID_HEADER,
    PrefillRequest,
    PrefillResponse,
    VerifyRequest,
    VerifyResponse,
)
from server.verifier.checks import routing_header, session_id_named
from server.verifier.round_path import answer_round, record_round
from server.verifier.routes import model_json
from server.verifier.state import AppState, SchedulerDep, key_id

router = APIRouter(tags=["sessions"])


@router.post("/prefill", response_model=PrefillResponse)
async def prefill(request: PrefillRequest, scheduler: SchedulerDep, http: Request) -> Response:
    header = routing_header(http.headers.getlist(SESSION_ID_HEADER))
    session_id = session_id_named(header, request.session_id)
    request = request.model_copy(update={"session_id": session_id})
    owner = key_id(http)
    opened = await scheduler.prefill(request, owner)
    if await http.is_disconnected():
        # Nobody will read the answer: a session nobody knows of would hold its sequence
        # until the idle TTL. (A client that chose the id and retries finds it free.)
        engine = scheduler.engine
        await scheduler.call(
            lambda: engine.discard_session(opened.session_id, opened),
            opened.session_id,
            owner,
            finishing=True,
        )
    return model_json(opened)


@router.post("/verify", response_model=VerifyResponse)
async def verify(request: VerifyRequest, http: Request) -> Response:
    """One speculative round: the pending token and the draft decoded together, the
    longest agreeing prefix accepted, plus one token of the verifier's. (Served before
    routing by server/verifier/round_path.py unless VERIFIER_VERIFY_FAST_PATH=false.)"""
    state: AppState = http.app.state.verifier
    routing = http.headers.getlist(SESSION_ID_HEADER)
    response = await answer_round(state, request, routing, key_id(http))
    return model_json(response, BackgroundTask(record_round, state, request, response))


@router.delete("/sessions/{session_id}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_session(session_id: str, scheduler: SchedulerDep, http: Request) -> None:
    session_id_named(routing_header(http.headers.getlist(SESSION_ID_HEADER)), session_id)
    engine, owner = scheduler.engine, key_id(http)
    await scheduler.call(lambda: engine.delete_session(session_id, owner), session_id, owner)
