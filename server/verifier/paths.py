"""The request path as the app's routes see it."""


def route_path(scope: dict) -> str:
    """`scope["path"]` without the root path (`uvicorn --root-path`, a mount, a proxy's
    prefix) that uvicorn keeps in front of it: what Starlette's router matches, so the
    /verify lane, the guard and the metrics decide on the same path as the routes."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root) :] or "/"
    return path
