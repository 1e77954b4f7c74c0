"""The request path as the app's routes see it."""

from starlette._utils import get_route_path
from starlette.types import Scope


def route_path(scope: Scope) -> str:
    """`scope["path"]` without the root path (`uvicorn --root-path`, a mount, a proxy's
    prefix) that uvicorn keeps in front of it, cut exactly where Starlette's router cuts it
    (its own function: a private one, but the same package as the router), so that the
    /verify fast path, the guard and the metrics decide on the path the routes match."""
    return get_route_path(scope)
