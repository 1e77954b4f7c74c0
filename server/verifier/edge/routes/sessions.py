"""Speculative rounds: open a session, verify drafts, close it."""

from fastapi import APIRouter, Request, Response, status

from server.shared.protocol import (
    SESSION_ID_HEADER,
    PrefillRequest,
    PrefillResponse,
    VerifyRequest,
    VerifyResponse,
)
from server.verifier.edge.routes import JSONRoute, model_json
from server.verifier.edge.state import ServiceDep, key_id

router = APIRouter(tags=["sessions"], route_class=JSONRoute)


@router.post("/prefill", response_model=PrefillResponse)
async def prefill(request: PrefillRequest, service: ServiceDep, http: Request) -> Response:
    routing = http.headers.getlist(SESSION_ID_HEADER)
    return model_json(await service.prefill(request, key_id(http), http.is_disconnected, routing))


@router.post("/verify", response_model=VerifyResponse)
async def verify(request: VerifyRequest, service: ServiceDep, http: Request) -> Response:
    """One speculative round: the pending token and the draft decoded together, the
    longest agreeing prefix accepted, plus one token of the verifier's. (Served before
    routing by server/verifier/edge/round_path.py unless VERIFIER_VERIFY_FAST_PATH=false.)"""
    routing = http.headers.getlist(SESSION_ID_HEADER)
    return model_json(await service.verify(request, key_id(http), routing))


@router.delete("/sessions/{session_id}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_session(session_id: str, service: ServiceDep, http: Request) -> None:
    await service.delete(session_id, key_id(http), http.headers.getlist(SESSION_ID_HEADER))
