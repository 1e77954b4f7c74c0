"""The verifier's HTTP routes, one module per concern."""

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel

from server.shared.request_body import read_json


class _ReadJSON(Request):
    async def json(self) -> Any:
        return read_json(await self.body())


class JSONRoute(APIRoute):
    """A route whose JSON body is read by `read_json`, as the /verify fast path reads one
    it refuses (server/verifier/edge/round_path.py): what it cannot read is refused as
    malformed_json (server/verifier/errors.py), before any work."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def handler(request: Request) -> Response:
            return await handle(_ReadJSON(request.scope, request.receive))

        return handler


def model_json(model: BaseModel) -> Response:
    """A response model serialized once by pydantic. Returning the model itself would have
    FastAPI validate it again and encode it twice, on the path of every round."""
    return Response(model.model_dump_json(), media_type="application/json")
