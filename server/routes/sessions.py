"""Speculative rounds: open a session, verify drafts, close it."""

from fastapi import APIRouter, Request, status

from server.protocol import PrefillRequest, PrefillResponse, VerifyRequest, VerifyResponse
from server.state import SchedulerDep, StateDep, key_id

router = APIRouter(tags=["sessions"])


@router.post("/prefill", response_model=PrefillResponse)
async def prefill(
    request: PrefillRequest, scheduler: SchedulerDep, http: Request
) -> PrefillResponse:
    return await scheduler.prefill(request, key_id(http))


@router.post("/verify", response_model=VerifyResponse)
async def verify(
    request: VerifyRequest, scheduler: SchedulerDep, state: StateDep, http: Request
) -> VerifyResponse:
    response = await scheduler.verify(request, key_id(http))
    state.metrics.observe_round(len(request.draft_tokens), response.accepted_prefix_len)
    return response


@router.delete("/sessions/{session_id}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_session(session_id: str, scheduler: SchedulerDep, http: Request) -> None:
    engine, owner = scheduler.engine, key_id(http)
    await scheduler.call(lambda: engine.delete_session(session_id, owner), session_id)
