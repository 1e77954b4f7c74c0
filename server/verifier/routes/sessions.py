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
from server.verifier.routes import model_json
from server.verifier.state import AppState, SchedulerDep, StateDep, key_id

router = APIRouter(tags=["sessions"])


@router.post("/prefill", response_model=PrefillResponse)
async def prefill(request: PrefillRequest, scheduler: SchedulerDep, http: Request) -> Response:
    header = routing_header(http.headers.getlist(SESSION_ID_HEADER))
    session_id = session_id_named(header, request.session_id)
    request = request.model_copy(update={"session_id": session_id})
    return model_json(await scheduler.prefill(request, key_id(http)))


@router.post("/verify", response_model=VerifyResponse)
async def verify(
    request: VerifyRequest, scheduler: SchedulerDep, state: StateDep, http: Request
) -> Response:
    """One speculative round: the pending token and the draft decoded together, the
    longest agreeing prefix accepted, plus one token of the verifier's."""
    session_id_named(routing_header(http.headers.getlist(SESSION_ID_HEADER)), request.session_id)
    response = await scheduler.verify(request, key_id(http))
    # Counted once the answer is on its way; a replayed answer was counted with its round.
    return model_json(response, BackgroundTask(record_round, state, request, response))


def record_round(state: AppState, request: VerifyRequest, response: VerifyResponse) -> None:
    if response._counted:
        return
    response._counted = True
    state.metrics.observe_round(len(request.draft_tokens), response.accepted_prefix_len)


@router.delete("/sessions/{session_id}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_session(session_id: str, scheduler: SchedulerDep, http: Request) -> None:
    session_id_named(routing_header(http.headers.getlist(SESSION_ID_HEADER)), session_id)
    engine, owner = scheduler.engine, key_id(http)
    await scheduler.call(lambda: engine.delete_session(session_id, owner), session_id, owner)
