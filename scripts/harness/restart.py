"""A verifier killed (SIGKILL) in the middle of a generation and started again with the
same command on the same port, while a client made with its default settings (the CLI,
or `serve` answering a streamed or a whole completion) goes on: whether the client
finishes, whether its output equals an undisturbed run, and how long it took.

`scripts/restart_drill.py` prints the table; tests/integration/test_resilience.py holds
the same drills to what they must show.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx

from scripts.harness.local import LocalServe, LocalVerifier, free_port
from scripts.harness.metrics import Metrics

CLI = "CLI"
SERVE_STREAMING = "serve, streaming"
SERVE_WHOLE = "serve, not streaming"
CLIENTS = (CLI, SERVE_STREAMING, SERVE_WHOLE)
# A restart of a 7B verifier takes minutes: what a drill gives the restarted one.
READY_TIMEOUT_S = 600.0


@dataclass
class Drilled:
    client: str
    finished: bool
    identical: bool
    recoveries: int  # sessions the client opened again on the restarted verifier
    restart_s: float  # from the kill to the restarted verifier's first 200 on /health
    finished_after_s: float  # from the kill to the client's last token
    error: str = ""


class Restarter:
    """Owns the verifier: kills it once it has answered `after_rounds` more rounds, then
    starts it again with the same settings and port (one kill per `arm`)."""

    def __init__(self, env: dict[str, str], after_rounds: int = 2):
        self.env = env
        self.port = free_port()
        self.after_rounds = after_rounds
        self.verifier = self._start()
        self.url = self.verifier.url
        self.killed_at = self.ready_at = float("nan")
        self._watcher: threading.Thread | None = None
        self._done = threading.Event()

    def _start(self) -> LocalVerifier:
        verifier = LocalVerifier(self.env, port=self.port)
        try:
            verifier.wait_ready(READY_TIMEOUT_S)
        except Exception:
            verifier.stop()
            raise
        return verifier

    def _rounds(self) -> float:
        return Metrics.scrape(self.url).value(
            "verifier_requests_total", endpoint="/verify", status="200"
        )

    def arm(self) -> None:
        before = self._rounds()
        self._done = threading.Event()

        def watch() -> None:
            while True:  # until the rounds are in, or the client finished first
                if self._done.is_set():
                    return
                try:
                    if self._rounds() >= before + self.after_rounds:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.01)
            self.verifier.process.send_signal(signal.SIGKILL)
            self.verifier.process.wait()
            self.killed_at = time.monotonic()
            self.verifier.stop()  # its log file
            self.verifier = self._start()
            self.ready_at = time.monotonic()

        self._watcher = threading.Thread(target=watch, daemon=True)
        self._watcher.start()

    def disarm(self) -> None:
        """Waits for the restart (if one began) to be over."""
        self._done.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None

    def close(self) -> None:
        self.verifier.stop()


def undisturbed(url: str, prompt: str, max_tokens: int) -> dict:
    """The verifier's own greedy decoding: the output every drill must end with."""
    response = httpx.post(
        f"{url}/generate", json={"prompt": prompt, "max_tokens": max_tokens}, timeout=600
    )
    response.raise_for_status()
    return response.json()


def cli_tokens(
    url: str, drafter: Path, prompt: str, max_tokens: int, threads: int
) -> tuple[list[int], int]:
    """The CLI with its default settings (restart wait, retries): the tokens it printed
    and the sessions it says it opened again."""
    script = Path(sys.executable).parent / "draft_token_generator"
    command = [str(script), "--server", url, "--model", str(drafter), "--prompt", prompt]
    command += ["--max-tokens", str(max_tokens), "--threads", str(threads), "--output", "json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=READY_TIMEOUT_S * 2)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr else "failed")
    out = json.loads(done.stdout)
    return out["tokens"], out["stats"]["recoveries"]


def serve_run(serve: LocalServe, prompt: str, max_tokens: int, stream: bool) -> tuple[str, int]:
    """A greedy completion from `serve` (streamed or whole): its text and the recoveries
    its generation says it made."""
    body = {"model": "any", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body["stream"] = stream
    url = f"{serve.url}/completions"
    with httpx.Client(timeout=READY_TIMEOUT_S * 2) as client:
        if not stream:
            response = client.post(url, json=body)
            if response.status_code != 200:
                raise RuntimeError(response.text)
            answer = response.json()
            return answer["choices"][0]["text"], answer["speculative"]["recoveries"]
        text, recoveries = [], 0
        with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(response.read().decode())
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                text.extend(choice["text"] for choice in chunk["choices"])
                if chunk.get("speculative"):
                    recoveries = chunk["speculative"]["recoveries"]
        return "".join(text), recoveries


def drill(
    restarter: Restarter, client: str, run: Callable[[], tuple[object, int]], expected: object
) -> Drilled:
    restarter.arm()
    try:
        output, recoveries = run()
        error = ""
    except Exception as exc:
        output, recoveries, error = None, 0, str(exc)
    done = time.monotonic()
    restarter.disarm()
    return Drilled(
        client=client,
        finished=output is not None,
        identical=output == expected,
        recoveries=recoveries,
        restart_s=restarter.ready_at - restarter.killed_at,
        finished_after_s=done - restarter.killed_at,
        error=error,
    )


def run_drills(
    env: dict[str, str],
    drafter: Path,
    prompt: str,
    max_tokens: int,
    threads: int,
    clients: tuple[str, ...] = CLIENTS,
) -> list[Drilled]:
    """One drill a client, each against a verifier killed and restarted while it runs."""
    restarter = Restarter(env)
    serve: LocalServe | None = None
    try:
        expected = undisturbed(restarter.url, prompt, max_tokens)
        results = []
        for client in clients:
            if client == CLI:
                run = partial(cli_tokens, restarter.url, drafter, prompt, max_tokens, threads)
                results.append(drill(restarter, client, run, expected["tokens"]))
                continue
            if serve is None:
                # Loaded (and its draft model checked) before the drills: what a user's
                # running `serve` is when the verifier restarts under it.
                serve = LocalServe(restarter.url, "--model", str(drafter), threads=threads)
                serve_run(serve, prompt, 1, stream=False)
            run = partial(serve_run, serve, prompt, max_tokens, client == SERVE_STREAMING)
            results.append(drill(restarter, client, run, expected["text"]))
        return results
    finally:
        if serve is not None:
            serve.stop()
        restarter.close()
