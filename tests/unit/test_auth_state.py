"""The verifier says at start how it authenticates: its key counts, or a warning when no
key guards a port beyond loopback."""

from __future__ import annotations

import logging

import pytest

from server.shared.api_keys import ApiKeys
from server.verifier.edge.app import log_auth_state


def said(caplog) -> list[tuple[int, str]]:
    return [
        (r.levelno, r.getMessage()) for r in caplog.records if r.name == "server.verifier.edge.app"
    ]


@pytest.mark.parametrize(
    ("argv", "keys", "expected"),
    [
        (["uvicorn", "server.main:app"], ["a", "b"], (logging.INFO, "API keys: 2, admin keys: 0")),
        (
            ["uvicorn", "server.main:app", "--host", "0.0.0.0"],
            [],
            (
                logging.WARNING,
                "no API keys (VERIFIER_API_KEYS): anyone who reaches 0.0.0.0 can use this verifier",
            ),
        ),
        (
            ["uvicorn", "server.main:app", "--host", "127.0.0.1"],
            [],
            (logging.INFO, "no API keys: open to whoever reaches the port (loopback here)"),
        ),
    ],
)
def test_the_auth_state_is_logged_once_at_start(monkeypatch, caplog, argv, keys, expected):
    monkeypatch.setattr("sys.argv", argv)
    logger = logging.getLogger("server.verifier.edge.app")
    # Caught at the logger itself: the app's own log setup may stop propagation upward.
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="server.verifier.edge.app"):
            log_auth_state(ApiKeys(keys), ApiKeys([]))
    finally:
        logger.removeHandler(caplog.handler)
    assert set(said(caplog)) == {expected}  # (seen twice where it also propagates)


def test_uvicorns_options_are_read_in_both_forms_and_its_own_sockets_are_not_probed(
    monkeypatch,
):
    import socket

    from server.verifier.edge.app import address_in_use, uvicorn_option

    monkeypatch.setattr("sys.argv", ["uvicorn", "server.main:app", "--host=0.0.0.0"])
    assert uvicorn_option("--host", "127.0.0.1") == "0.0.0.0"
    assert uvicorn_option("--port", "8000") == "8000"
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        argv = ["uvicorn", "server.main:app", "--host", "127.0.0.1", f"--port={port}"]
        monkeypatch.setattr("sys.argv", argv)
        assert address_in_use() == f"127.0.0.1:{port}"
        monkeypatch.setattr("sys.argv", [*argv, "--workers", "2"])  # uvicorn's own socket
        assert address_in_use() is None
    monkeypatch.setattr("sys.argv", ["pytest"])
    assert address_in_use() is None and uvicorn_option("--host", "x") is None
