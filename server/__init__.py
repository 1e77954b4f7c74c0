"""hetero-specdecode's server side, in two layers: `server.shared` (what the verifier and
the drafter both import: the wire protocol, sampling and acceptance rules, vocabulary
rules, the llama.cpp wrapper; no web stack) and `server.verifier` (the FastAPI verifier).
`uvicorn server.main:app` serves the verifier."""
