"""Speculative rounds: open a session, verify drafts, close it."""

from fastapi import APIRouter, status

from server.protocol import PrefillRequest, PrefillResponse, VerifyRequest, VerifyResponse
from server.state import EngineDep, StateDep

router = APIRouter(tags=["sessions"])


@router.post("/prefill", response_model=PrefillResponse)
async def prefill(request: PrefillRequest, engine: EngineDep, state: StateDep) -> PrefillResponse:
    response = await state.worker.run(engine.prefill, request)
    state.metrics.active_sessions.set(engine.session_count)
    state.metrics.decoded_tokens.inc(max(response.prompt_len - 1, 0))
    return response


@router.post("/verify", response_model=VerifyResponse)
async def verify(request: VerifyRequest, engine: EngineDep, state: StateDep) -> VerifyResponse:
    response = await state.worker.run(engine.verify, request)
    metrics = state.metrics
    metrics.drafted_tokens.inc(len(request.draft_tokens))
    metrics.accepted_tokens.inc(response.accepted_prefix_len)
    metrics.decoded_tokens.inc(response.timings.decoded_tokens)
    metrics.verify_decode_seconds.observe(response.timings.decode_ms / 1000.0)
    return response


@router.delete("/sessions/{session_id}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_session(session_id: str, engine: EngineDep, state: StateDep) -> None:
    await state.worker.run(engine.delete_session, session_id)
    state.metrics.active_sessions.set(engine.session_count)
