"""The verifier app, for `uvicorn server.main:app`."""

import sys

from pydantic import ValidationError

from server.verifier.edge.app import create_app

try:
    app = create_app()
except ValidationError as exc:  # a VERIFIER_* variable mistyped, or out of range
    problems = "\n".join(
        f"  {'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg'].removeprefix('Value error, ')}"
        for e in exc.errors()
    )
    sys.exit(f"the verifier's settings are not valid:\n{problems}")
