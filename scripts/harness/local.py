"""A verifier in a subprocess on 127.0.0.1, for tests, benchmarks and the load test:
`uvicorn server.main:app` started, waited for (GET /health), stopped."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from server.shared.defaults import REPO_ROOT


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process(process: subprocess.Popen) -> None:
    """SIGTERM (a graceful stop), then SIGKILL if it has not ended in 15 s."""
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_healthy(url: str, process: subprocess.Popen, what: str, timeout: float = 300.0) -> None:
    """Until `url`/health answers 200 (another server's: llama.cpp's); a RuntimeError
    naming `what` if `process` ends first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} ended at start ({process.returncode})")
        conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=2)
        try:
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not become ready in {timeout:.0f} s")


class LocalVerifier:
    def __init__(
        self,
        env: dict[str, str],
        port: int | None = None,
        extra_args: Sequence[str] = (),
        scheme: str = "http",
        command_prefix: Sequence[str] = (),
        source: Path | None = None,
    ):
        """`command_prefix` runs the server under another command (`taskset -c 1`);
        `source`: another checkout of this repository whose verifier to run (A/B runs)."""
        self.port = port or free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.scheme = scheme
        self.env = env
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"verifier-{self.port}.log"
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [
                *command_prefix,
                sys.executable,
                "-m",
                "uvicorn",
                "server.main:app",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                *extra_args,
            ],
            cwd=source or REPO_ROOT,
            env={**os.environ, **({"PYTHONPATH": str(source)} if source else {}), **env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def healthy(self) -> bool:
        if self.scheme == "https":
            import ssl

            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                "127.0.0.1", self.port, timeout=1.0, context=ssl._create_unverified_context()
            )
        else:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1.0)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status in (200, 401)  # 401: up, with a key of its own
        except OSError:
            return False
        finally:
            conn.close()

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"verifier exited: {self.log_path.read_text()[-2000:]}")
            if self.healthy():
                return
            time.sleep(0.1)
        raise RuntimeError(f"verifier not ready in {timeout}s: {self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        stop_process(self.process)
        self._log.close()
        self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> LocalVerifier:
        try:
            self.wait_ready()
        except Exception:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalServe:
    """`draft_token_generator serve` (the drafter's OpenAI endpoint) in a subprocess on
    127.0.0.1, waited for (GET /v1/models answered); its log in a file (a pipe nobody reads would
    fill up and stop it)."""

    def __init__(
        self,
        verifier_url: str,
        *extra_args: str,
        threads: int = 1,
        command_prefix: Sequence[str] = (),
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
        loaded: bool = False,
    ):
        """`loaded`: wait as well until its draft model is loaded (GET /health), so that
        a first request's time is a request's, not the load's."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        script = Path(sys.executable).parent / "draft_token_generator"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"serve-{self.port}.log"
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [
                *command_prefix,
                str(script),
                "serve",
                "--server",
                verifier_url,
                "--port",
                str(self.port),
                "--threads",
                str(threads),
                *extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            env={**os.environ, **(env or {})},
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._answers("/v1/models") and (not loaded or self._loaded()):
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        log = self.stop()
        raise RuntimeError(f"the local OpenAI server did not start:\n{log[-2000:]}")

    def _answers(self, path: str) -> bool:
        return self._get(path)[0] in (200, 401)  # 401: up, with a key of its own

    def _loaded(self) -> bool:
        status, body = self._get("/health")
        try:
            return status is not None and bool(json.loads(body).get("draft_model_loaded"))
        except ValueError:
            return False

    def _get(self, path: str) -> tuple[int | None, bytes]:
        """The status and body of GET `path`; (None, b"") while nothing answers."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5.0)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        except OSError:
            return None, b""
        finally:
            conn.close()

    def stop(self) -> str:
        """Stops it; returns its log."""
        stop_process(self.process)
        self._log.close()
        log = self.log_path.read_text()
        self.log_path.unlink(missing_ok=True)
        return log
