"""`draft_token_generator serve`: a local OpenAI-compatible API over the speculative loop.
Needs the `serve` extra (FastAPI, uvicorn, sse-starlette); the rest of the drafter does not."""
