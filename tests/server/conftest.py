import contextlib
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from server.verifier.edge.app import create_app
from server.verifier.settings import VerifierSettings
from tests.conftest import TEST_N_CTX, TEST_THREADS

MAX_DRAFT = 8


def wait_healthy(client: TestClient, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.get("/health").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError(f"verifier not healthy: {client.get('/health').json()}")


@contextlib.contextmanager
def verifier_client(verifier_model, **settings) -> Iterator[TestClient]:
    """The verifier app on the real model, loaded and probed; `settings` over the tests'."""
    # No idle work: tests here count the tokens a request decodes (runtime counters), and
    # a cached prefix evaluated again in a gap between requests would add to them.
    defaults = {
        "n_ctx": TEST_N_CTX,
        "n_threads": TEST_THREADS,
        "max_sessions": 4,
        "idle_retile_after_s": 0.0,
    }
    app = create_app(
        VerifierSettings(model_path=verifier_model, max_draft=MAX_DRAFT, **defaults | settings)
    )
    with TestClient(app) as test_client:
        wait_healthy(test_client)
        yield test_client


@pytest.fixture(scope="module")
def client(verifier_model) -> Iterator[TestClient]:
    with verifier_client(verifier_model) as test_client:
        yield test_client


@pytest.fixture
def engine(client):
    return client.app.state.verifier.service.engine
