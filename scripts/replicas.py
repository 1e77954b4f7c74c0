#!/usr/bin/env python3
"""Verifier replicas behind nginx.

    .venv/bin/python scripts/replicas.py up -n 3            # 3 verifiers + nginx on 127.0.0.1
    .venv/bin/python scripts/replicas.py config --replica 10.0.0.11:8000 --replica 10.0.0.12:8000 \\
        --listen 8000 > /etc/nginx/conf.d/hetero-verifier.conf

`up` runs until Ctrl-C: point drafters at the URL it prints (`--server`). The verifiers
take the usual VERIFIER_* settings from the environment; with none given each gets one
thread and the test context length, so that three fit on a small machine.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import contextlib

from scripts.harness.cli import HelpFormatter, first_paragraph
from scripts.harness.replicas import LocalReplicas, render_site
from server.verifier.settings import VerifierSettings

SMALL_MACHINE = {"VERIFIER_N_THREADS": "1", "VERIFIER_N_CTX": "1024"}


def up(n: int) -> None:
    env = {**SMALL_MACHINE, **{k: v for k, v in os.environ.items() if k.startswith("VERIFIER_")}}
    print(f"[replicas] starting {n} verifiers and nginx on 127.0.0.1 ...", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with LocalReplicas(n, env, VerifierSettings().max_body_bytes) as replicas:
        for verifier in replicas.verifiers:
            print(f"[replicas] verifier {verifier.url} (log: {verifier.log_path})")
        print(f"[replicas] balancer {replicas.url} (logs: {replicas.balancer.prefix})")
        print(f"[replicas] ready: draft_token_generator --server {replicas.url} ...", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()
    print("[replicas] stopped")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=first_paragraph(__doc__), formatter_class=HelpFormatter
    )
    commands = parser.add_subparsers(
        dest="command", required=True, help="What to do (each has its own --help)."
    )
    start = commands.add_parser(
        "up",
        help="Start N verifiers and nginx on 127.0.0.1.",
        description="Start N verifiers and nginx in front of them on 127.0.0.1, and run until\n"
        "Ctrl-C: point drafters at the URL it prints (--server). The verifiers take the\n"
        "usual VERIFIER_* settings from the environment; with none given each gets one\n"
        "thread and the test context length, so that three fit on a small machine.",
        formatter_class=HelpFormatter,
    )
    start.add_argument("-n", type=int, default=3, help="Verifier replicas to start (at least 1).")
    config = commands.add_parser(
        "config",
        help="Print nginx's config for given replicas.",
        description="Print nginx's config (the http-context part, for conf.d/) that balances\n"
        "drafters over the given verifier replicas.",
        formatter_class=HelpFormatter,
    )
    config.add_argument(
        "--replica",
        action="append",
        required=True,
        help="A verifier's host:port; required, repeat for each replica.",
    )
    config.add_argument(
        "--listen", default="8000", help="nginx's listen address (port, or host:port)."
    )
    config.add_argument(
        "--max-body-bytes",
        type=int,
        default=VerifierSettings.model_fields["max_body_bytes"].default,
        help="Largest request body nginx passes on: the verifiers' VERIFIER_MAX_BODY_BYTES.",
    )
    args = parser.parse_args()
    if args.command == "up":
        if args.n < 1:
            parser.error("-n must be at least 1")
        up(args.n)
    else:
        print(render_site(args.replica, args.listen, args.max_body_bytes), end="")


if __name__ == "__main__":
    main()
