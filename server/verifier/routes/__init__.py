"""The verifier's HTTP routes, one module per concern."""

from fastapi import Response
from pydantic import BaseModel


def model_json(model: BaseModel) -> Response:
    """A response model serialized once by pydantic. Returning the model itself would have
    FastAPI validate it again and encode it twice, on the path of every round."""
    return Response(model.model_dump_json(), media_type="application/json")
