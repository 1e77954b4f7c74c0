"""The verifier alone, for baselines and as a fallback."""

from fastapi import APIRouter, Request

from server.shared.protocol import GenerateRequest, GenerateResponse
from server.verifier.edge.routes import JSONRoute
from server.verifier.edge.state import ServiceDep, StateDep, key_id
from server.verifier.errors import ContextOverflow

router = APIRouter(tags=["generate"], route_class=JSONRoute)


@router.post("/generate", response_model=GenerateResponse)
async def generate(
    request: GenerateRequest, service: ServiceDep, state: StateDep, http: Request
) -> GenerateResponse:
    limit = state.settings.max_generate_tokens
    if request.max_tokens > limit:
        raise ContextOverflow(f"max_tokens={request.max_tokens} exceeds this server's {limit}")
    return await service.generate(request, key_id(http), http.is_disconnected)
