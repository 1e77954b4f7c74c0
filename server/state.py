"""What the app holds while it runs: the engine once loaded, its worker, its metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from server.engine import Engine
from server.errors import ModelNotReady
from server.metrics import VerifierMetrics
from server.settings import VerifierSettings
from server.worker import ModelWorker


@dataclass
class AppState:
    settings: VerifierSettings
    worker: ModelWorker = field(default_factory=ModelWorker)
    metrics: VerifierMetrics = field(default_factory=VerifierMetrics)
    engine: Engine | None = None
    load_error: str | None = None


def get_state(request: Request) -> AppState:
    return request.app.state.verifier


def get_engine(state: Annotated[AppState, Depends(get_state)]) -> Engine:
    if state.engine is None:
        if state.load_error:
            raise ModelNotReady(f"the model failed to load: {state.load_error}")
        raise ModelNotReady()
    return state.engine


StateDep = Annotated[AppState, Depends(get_state)]
EngineDep = Annotated[Engine, Depends(get_engine)]
