"""What the app holds while it runs: the engine once loaded, its scheduler, its metrics."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from server.verifier.engine import Engine
from server.verifier.errors import ModelNotReady
from server.verifier.metrics import VerifierMetrics
from server.verifier.scheduler import BatchScheduler
from server.verifier.settings import VerifierSettings


@dataclass
class AppState:
    settings: VerifierSettings
    metrics: VerifierMetrics
    engine: Engine | None = None
    scheduler: BatchScheduler | None = None
    load_error: str | None = None
    # GET /vocab's file, written once on first demand (server/vocab_file.py).
    vocab_file: bytes | None = None
    vocab_file_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


# The dependencies are coroutines: FastAPI runs a plain function dependency in a worker
# thread, a hand-off on every request (the largest part of a round's protocol overhead).
async def get_state(request: Request) -> AppState:
    return request.app.state.verifier


def scheduler_of(state: AppState) -> BatchScheduler:
    """The running scheduler, or 503 while the model loads (or failed to)."""
    if state.scheduler is None:
        if state.load_error:
            raise ModelNotReady(f"the model failed to load: {state.load_error}")
        raise ModelNotReady()
    return state.scheduler


def key_id(request: Request) -> str:
    """Who is calling: the identity the API-key guard put on the request."""
    return getattr(request.state, "key_id", "anonymous")


async def get_scheduler(state: Annotated[AppState, Depends(get_state)]) -> BatchScheduler:
    return scheduler_of(state)


StateDep = Annotated[AppState, Depends(get_state)]
SchedulerDep = Annotated[BatchScheduler, Depends(get_scheduler)]
