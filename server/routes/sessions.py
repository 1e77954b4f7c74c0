"""Speculative rounds: open a session, verify drafts, close it."""

from fastapi import APIRouter, status

from server.protocol import PrefillRequest, PrefillResponse, VerifyRequest, VerifyResponse
from server.state import SchedulerDep, StateDep

router = APIRouter(tags=["sessions"])


@router.post("/prefill", response_model=PrefillResponse)
async def prefill(request: PrefillRequest, scheduler: SchedulerDep) -> PrefillResponse:
    return await scheduler.prefill(request)


@router.post("/verify", response_model=VerifyResponse)
async def verify(
    request: VerifyRequest, scheduler: SchedulerDep, state: StateDep
) -> VerifyResponse:
    response = await scheduler.verify(request)
    state.metrics.observe_round(len(request.draft_tokens), response.accepted_prefix_len)
    return response


@router.delete("/sessions/{session_id}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_session(session_id: str, scheduler: SchedulerDep) -> None:
    engine = scheduler.engine
    await scheduler.call(lambda: engine.delete_session(session_id), session_id)
