"""Health, model facts, the vocabulary file and metrics."""

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from server.shared.info import InfoResponse
from server.shared.protocol import HealthResponse
from server.verifier.edge.routes import JSONRoute
from server.verifier.edge.state import ServiceDep, StateDep

router = APIRouter(tags=["service"], route_class=JSONRoute)


@router.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
async def health(state: StateDep) -> JSONResponse:
    # Never waits for the engine: it answers while a long prefill runs.
    if state.service is not None:
        return JSONResponse(HealthResponse(status="ok").model_dump(exclude_none=True))
    body = (
        HealthResponse(status="error", detail=state.load_error)
        if state.load_error
        else HealthResponse(status="loading")
    )
    return JSONResponse(body.model_dump(exclude_none=True), status_code=503)


@router.get("/info", response_model=InfoResponse)
async def info(service: ServiceDep) -> InfoResponse:
    return service.info()


@router.get(
    "/vocab",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}}}, 304: {}},
)
async def vocab(request: Request, service: ServiceDep) -> Response:
    """The verifier's vocabulary as a GGUF file without tensors (llama.cpp loads it with
    `vocab_only`): tokenizer, chat template, special tokens. Its ETag is the vocabulary
    hash of /info, so a drafter keeps one copy per vocabulary."""
    etag = service.vocab_etag()
    headers = {"ETag": etag, "Cache-Control": "private, max-age=0, must-revalidate"}
    if none_match(request.headers.getlist("if-none-match"), etag):
        return Response(status_code=304, headers=headers)
    body = await service.vocab_file()
    headers["Content-Disposition"] = f'attachment; filename="{service.vocab_file_name()}"'
    return Response(body, media_type="application/octet-stream", headers=headers)


@router.get("/metrics", response_class=Response)
async def metrics(state: StateDep) -> Response:
    if state.service is not None:
        state.metrics.active_sessions.set(state.service.session_count())
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def none_match(fields: list[str], etag: str) -> bool:
    """If-None-Match as RFC 9110 reads it: `*`, or a list of entity tags, compared weakly
    (W/"x" matches "x")."""
    ours = etag.removeprefix("W/")
    for field in fields:
        for tag in field.split(","):
            tag = tag.strip()
            if tag == "*" or tag.removeprefix("W/") == ours:
                return True
    return False
