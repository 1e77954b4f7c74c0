"""The verifier: a FastAPI app over one llama.cpp context (`server.verifier.edge.app`), its
engine, batch scheduler and session table, routes, settings and metrics."""
