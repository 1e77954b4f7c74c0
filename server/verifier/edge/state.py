"""What the app holds while it runs: its settings and metrics, and the service once the
model is loaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from server.verifier.errors import ModelFailed, ModelNotReady
from server.verifier.metrics import VerifierMetrics
from server.verifier.scheduling.service import VerifierService
from server.verifier.settings import VerifierSettings


@dataclass
class AppState:
    settings: VerifierSettings
    metrics: VerifierMetrics
    service: VerifierService | None = None
    load_error: str | None = None


# The dependencies are coroutines: FastAPI runs a plain function dependency in a worker
# thread, a hand-off on every request (the largest part of a round's protocol overhead).
async def get_state(request: Request) -> AppState:
    return request.app.state.verifier


def service_of(state: AppState) -> VerifierService:
    """The running service, or 503 while the model loads (or failed to)."""
    if state.service is None:
        if state.load_error:
            raise ModelFailed(f"the model failed to load: {state.load_error}")
        raise ModelNotReady()
    return state.service


def key_id(request: Request) -> str:
    """Who is calling: the identity the API-key guard put on the request."""
    return getattr(request.state, "key_id", "anonymous")


async def get_service(state: Annotated[AppState, Depends(get_state)]) -> VerifierService:
    return service_of(state)


StateDep = Annotated[AppState, Depends(get_state)]
ServiceDep = Annotated[VerifierService, Depends(get_service)]
