"""The verifier app, for `uvicorn server.main:app`."""

from server.verifier.app import create_app

app = create_app()
