"""What the verifier and the drafter both import, and nothing else: the wire protocol,
the sampling and acceptance rules, the vocabulary rules, the llama.cpp wrapper (the one
module that imports llama_cpp), batched decoding, model defaults. Neither FastAPI nor
uvicorn nor prometheus_client is imported here (the import contract in pyproject.toml
holds it), so a drafter installs without them."""
