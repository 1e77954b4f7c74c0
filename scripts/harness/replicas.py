"""Verifier replicas behind nginx: the config in `deploy/nginx` rendered for given
replicas, and on loopback a private nginx in front of N local verifiers (the demo, the
load test, the tests). Balancing is nginx's; this only writes its config and runs it."""

from __future__ import annotations

import http.client
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from scripts.harness.local import LocalVerifier, free_port, stop_process
from server.shared.defaults import REPO_ROOT

NGINX_DIR = REPO_ROOT / "deploy" / "nginx"
SITE_TEMPLATE = NGINX_DIR / "hetero-verifier.conf"
LOOPBACK_TEMPLATE = NGINX_DIR / "loopback.conf"
# Where package managers put it; /usr/sbin is not on every user's PATH.
NGINX_PLACES = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/opt/homebrew/bin/nginx")
INSTALL_HINT = (
    "install it with the system's package manager (Debian/Ubuntu: apt-get install "
    "nginx; macOS: brew install nginx); ./scripts/test.sh does so where it can"
)


# A line of loopback.conf's access log.
ACCESS_LINE = re.compile(r'session=(?P<session>\S+) replicas="(?P<replicas>[^"]*)"')


class NginxMissing(RuntimeError):
    pass


def find_nginx() -> str:
    found = shutil.which("nginx") or next((p for p in NGINX_PLACES if os.access(p, os.X_OK)), None)
    if found is None:
        raise NginxMissing(f"nginx is not installed: {INSTALL_HINT}")
    return found


def fill(template: str, fields: Mapping[str, str]) -> str:
    for name, value in fields.items():
        template = template.replace("{{" + name + "}}", value)
    if left := re.search(r"\{\{\w+\}\}", template):
        raise ValueError(f"the nginx template's field {left.group()} is left unfilled")
    return template


CLIENT_TIMEOUT_S = 10
MAX_CONNS_PER_CLIENT = 256


def render_site(
    replicas: Sequence[str],
    listen: str,
    max_body_bytes: int,
    client_timeout_s: int = CLIENT_TIMEOUT_S,
    max_conns: int = MAX_CONNS_PER_CLIENT,
) -> str:
    """The http-context config for `replicas` (host:port each)."""
    if not replicas:
        raise ValueError("at least one replica is needed")
    servers = "\n".join(f"    server {r} max_fails=1 fail_timeout=5s;" for r in replicas)
    return fill(
        SITE_TEMPLATE.read_text(),
        {
            "servers": servers,
            "listen": listen,
            "max_body": f"{max_body_bytes // 1024}k",
            "client_timeout": f"{client_timeout_s}s",
            "max_conns": str(max_conns),
        },
    )


class LocalBalancer:
    """nginx on 127.0.0.1 in the foreground, everything under a private directory."""

    def __init__(
        self,
        replicas: Sequence[str],
        max_body_bytes: int,
        timeout: float = 30.0,
        **limits: int,
    ):
        """`limits`: render_site's client_timeout_s and max_conns."""
        nginx = find_nginx()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.prefix = Path(tempfile.mkdtemp(prefix="nginx-"))
        # A root master hands work to an unprivileged worker, which must reach this.
        self.prefix.chmod(0o755)
        site = self.prefix / "site.conf"
        site.write_text(render_site(replicas, f"127.0.0.1:{self.port}", max_body_bytes, **limits))
        main = self.prefix / "nginx.conf"
        main.write_text(
            fill(LOOPBACK_TEMPLATE.read_text(), {"prefix": str(self.prefix), "site": str(site)})
        )
        self.access_log = self.prefix / "access.log"
        self.error_log = self.prefix / "error.log"
        self.process = subprocess.Popen(
            # -e: the error log before the config is read (the default path needs root).
            [nginx, "-p", str(self.prefix), "-c", str(main), "-e", str(self.error_log)],
            stdout=subprocess.DEVNULL,
            stderr=self.error_log.open("a"),
        )
        deadline = time.monotonic() + timeout
        while not self._listening():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"nginx did not start: {self.error_log.read_text()[-2000:]}")
            time.sleep(0.05)

    def _listening(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1.0)
        try:
            conn.connect()
            return True
        except OSError:
            return False
        finally:
            conn.close()

    def wait_logged(self, session_ids: Sequence[str], timeout: float = 60.0) -> None:
        """Until every session's DELETE is in the access log (nginx writes a request's
        line after its answer is sent)."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.access_log.read_text()
            if all(f"DELETE /sessions/{s} " in text for s in session_ids):
                return
            if time.monotonic() > deadline:
                raise AssertionError("the access log never showed every session's DELETE")
            time.sleep(0.05)

    def replica_of_sessions(self) -> dict[str, set[str]]:
        """Each session id in the access log, with the replicas that answered it."""
        answered: dict[str, set[str]] = {}
        for line in self.access_log.read_text().splitlines():
            entry = ACCESS_LINE.search(line)
            if entry and entry["session"] != "-":
                last = re.split(r"[,:] ", entry["replicas"])[-1]
                answered.setdefault(entry["session"], set()).add(last)
        return answered

    def stop(self) -> None:
        if self.process.poll() is None:
            stop_process(self.process)
        shutil.rmtree(self.prefix, ignore_errors=True)


class LocalReplicas:
    """N verifiers on 127.0.0.1, each with `env`, behind one LocalBalancer."""

    def __init__(
        self,
        n: int,
        env: Mapping[str, str],
        max_body_bytes: int,
        command_prefix: Sequence[str] = (),
        **limits: int,
    ):
        """`command_prefix` runs each verifier under another command (`taskset -c 1`);
        `limits`: the balancer's (render_site)."""
        self.verifiers: list[LocalVerifier] = []
        self.balancer: LocalBalancer | None = None
        try:
            # Started together: they load and probe their models side by side.
            # Passive checks only in open-source nginx: a loading replica refuses
            # connections, so that it is passed over rather than answering 503.
            env = {**env, "VERIFIER_LISTEN_AFTER_LOAD": "true"}
            self.verifiers = [
                LocalVerifier(dict(env), command_prefix=command_prefix) for _ in range(n)
            ]
            for verifier in self.verifiers:
                verifier.wait_ready(timeout=300)
            self.balancer = LocalBalancer(
                [f"127.0.0.1:{v.port}" for v in self.verifiers], max_body_bytes, **limits
            )
        except BaseException:
            self.stop()
            raise
        self.url = self.balancer.url

    def stop(self) -> None:
        if self.balancer is not None:
            self.balancer.stop()
        for verifier in self.verifiers:
            verifier.stop()

    def __enter__(self) -> LocalReplicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
