"""The docs cannot drift: every command in README.md and docs/*.md is run against a live
verifier (and `serve`) or checked against the program it names, every documented answer
is compared with the live one, and every setting, path and link they name exists."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import click
import httpx
import pytest
import typer

from drafter.cli import app as drafter_app
from drafter.settings import DrafterSettings
from scripts.harness.local import LocalServe
from server.shared.defaults import REPO_ROOT
from server.verifier.settings import VerifierSettings
from tests.conftest import TEST_THREADS

pytestmark = pytest.mark.integration

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
VERIFIER_EXAMPLE = "localhost:8000"
SERVE_EXAMPLE = "localhost:8080"
README_MAX_LINES = 250
# Commands the docs may show that this test neither runs nor parses: they act on the
# reader's own machine (a clone, a key, a system's nginx, a coding agent).
NOT_CHECKED = {
    *("git", "ln", "cd", "export", "sudo", "openssl", "tee", "nginx", "claude", "codex", "ssh"),
}
LOG_BOOK = re.compile(
    r"previous session|in the session that|this task|was lent|this round of work|"
    r"before this change|issue \d+|as before\b|since replaced",
    re.IGNORECASE,
)


@dataclass
class Block:
    language: str
    text: str
    follows_directly: bool  # nothing but blank lines since the previous block


def blocks(doc: Path) -> list[Block]:
    found, previous_end = [], None
    content = doc.read_text()
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", content, re.M | re.S):
        adjacent = previous_end is not None and not content[previous_end : match.start()].strip()
        found.append(Block(match[1], match[2], adjacent))
        previous_end = match.end()
    return found


def commands(text: str) -> list[str]:
    """A shell block's commands: continuation lines and quoted newlines joined."""
    out, pending = [], ""
    for line in text.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        if shlex.split(pending, comments=True):
            out.append(pending)
        pending = ""
    assert not pending, f"unterminated command: {pending}"
    return out


def segments(command: str) -> list[tuple[dict[str, str], list[str]]]:
    """(variables set, argv) for each command of a pipeline or `&&` chain."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars="|&;")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    parts: list[list[str]] = [[]]
    for token in lexer:
        if token in {"|", "&&", ";", "||"}:
            parts.append([])
        else:
            parts[-1].append(token)
    out = []
    for argv in parts:
        env = {}
        while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
            name, _, value = argv.pop(0).partition("=")
            env[name] = value
        if argv:
            out.append((env, argv))
    return out


def extras() -> set[str]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


def check_drafter_args(args: list[str]) -> None:
    """The arguments parse as the CLI parses them (options known, values of their type)."""
    command = typer.main.get_command(drafter_app)
    try:
        context = command.make_context("draft_token_generator", list(args))
        # The subcommand, if any (click keeps it apart from the arguments after it).
        protected = getattr(context, "_protected_args", [])
        rest = [*protected, *context.args]
        if rest and rest[0] == "serve":
            command.get_command(context, "serve").make_context("serve", rest[1:], parent=context)
        else:
            assert not rest, f"unexpected arguments {rest}"
    except click.exceptions.Exit:
        pass  # --help


def script_options(script: str, args: list[str]) -> set[str]:
    subcommand = [args[0]] if args and not args[0].startswith("-") else []
    shown = subprocess.run(
        [sys.executable, script, *subcommand, "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    return set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", shown.stdout))


def check_static(env: dict[str, str], argv: list[str], where: str) -> None:
    """A command checked against the program it names, without running it."""
    for name in env:
        if name.startswith("VERIFIER_"):
            assert name.removeprefix("VERIFIER_").lower() in VerifierSettings.model_fields, name
    if "EXTRAS" in env:
        assert set(env["EXTRAS"].split(",")) <= extras(), (where, env["EXTRAS"])
    program, args = argv[0], argv[1:]
    if program in NOT_CHECKED:
        return
    assert program not in {"python", "python3"}, f"{where}: use .venv/bin/python ({argv})"
    if program in {".venv/bin/draft_token_generator", "./scripts/demo.sh"}:
        check_drafter_args(args)
    elif program.startswith("./scripts/"):
        assert (REPO_ROOT / program).stat().st_mode & 0o111, program
        # A script of stages shows each in its own header: `./scripts/x.sh STAGE`.
        usage = (REPO_ROOT / program).read_text()
        assert not args or f"{program} {args[0]}" in usage, f"{where}: {argv}"
    elif program == ".venv/bin/uvicorn":
        assert args[0] == "server.main:app", argv
        shown = subprocess.run(
            [sys.executable, "-m", "uvicorn", "--help"], capture_output=True, text=True
        ).stdout
        for option in (a for a in args if a.startswith("--")):
            assert option in shown, (where, option)
    elif program == ".venv/bin/python" and args[:2] == ["-m", "pip"]:
        for extra in re.findall(r"\.\[(\w+)\]", " ".join(args)):
            assert extra in extras(), (where, extra)
    elif program == ".venv/bin/python" and args[:1] == ["-m"]:
        shown = subprocess.run(
            [sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
        )
        assert shown.returncode == 0, (where, args, shown.stderr)
    elif program == ".venv/bin/python":
        script, script_args = args[0], args[1:]
        assert (REPO_ROOT / script).is_file(), (where, script)
        known = script_options(script, script_args)
        for option in (a for a in script_args if a.startswith("-")):
            assert option.split("=", 1)[0] in known, (where, script, option)  # --name=value
    else:
        raise AssertionError(f"{where}: the docs test does not know how to check {argv}")


def curl(argv: list[str], urls: dict[str, str]) -> httpx.Response:
    """The request a documented curl command makes (curl may not be installed)."""
    method, headers, data, url = None, {}, None, None
    args = iter(argv[1:])
    for arg in args:
        if arg in {"-s", "-sN", "-N"}:
            continue
        if arg == "-X":
            method = next(args)
        elif arg == "-H":
            name, _, value = next(args).partition(":")
            headers[name.strip()] = value.strip()
        elif arg == "-d":
            data = next(args)
        else:
            assert not arg.startswith("-"), f"curl option {arg} is not interpreted here"
            url = arg
    assert url is not None, argv
    for example, live in urls.items():
        url = url.replace(example, live)
    method = method or ("POST" if data is not None else "GET")
    return httpx.request(method, f"http://{url}", headers=headers, content=data, timeout=300)


def same_shape(documented, live, path: str = "") -> None:
    """The documented answer's fields are the live answer's; their values too, but for
    times, the advised draft length (from measured pass times) and the sessions the
    verifier's passes held (a running mean), which vary."""
    if isinstance(documented, dict):
        assert isinstance(live, dict) and set(documented) == set(live), (path, documented, live)
        for key in documented:
            same_shape(documented[key], live[key], f"{path}.{key}")
    elif path.startswith(".timings."):
        assert isinstance(live, int | float), path
    elif path == ".advised_draft":
        assert isinstance(live, int), path
    elif path == ".pass_sessions":
        assert isinstance(live, int | float) and live >= 1, path
    else:
        assert documented == live, (path, documented, live)


@pytest.fixture(scope="module")
def live_urls(live_verifier):
    serve = LocalServe(live_verifier.url, threads=TEST_THREADS)
    try:
        yield {
            VERIFIER_EXAMPLE: live_verifier.url.removeprefix("http://"),
            SERVE_EXAMPLE: serve.url.removeprefix("http://").removesuffix("/v1"),
        }
    finally:
        serve.stop()


def test_every_command_runs_or_parses_and_every_answer_is_the_live_one(live_urls):
    checked = compared = 0
    for doc in DOCS:
        where = doc.relative_to(REPO_ROOT)
        last_answer: httpx.Response | None = None
        for block in blocks(doc):
            if not block.follows_directly:
                last_answer = None  # a documented answer stands right under its command
            if block.language == "bash":
                for command in commands(block.text):
                    for env, argv in segments(command):
                        if argv[0] == "curl" and any(u in command for u in live_urls):
                            last_answer = curl(argv, live_urls)
                            assert last_answer.status_code < 300, (where, argv, last_answer.text)
                        else:
                            check_static(env, argv, str(where))
                        checked += 1
            elif block.language == "json" and last_answer is not None:
                same_shape(json.loads(block.text), last_answer.json())
                last_answer = None
                compared += 1
            elif block.language == "python":
                code = block.text
                for example, live in live_urls.items():
                    code = code.replace(f"http://{example}", f"http://{live}")
                ran = subprocess.run(
                    [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
                )
                assert ran.returncode == 0, (where, ran.stderr)
                checked += 1
    assert checked > 30 and compared >= 2  # the docs' commands and answers were found


def test_every_setting_path_and_link_the_docs_name_exists():
    drafter_variables = {f"DRAFTER_{name.upper()}" for name in DrafterSettings.model_fields}
    for doc in DOCS:
        text = doc.read_text()
        for name in re.findall(r"\bVERIFIER_[A-Z0-9_]+\b", text):
            assert name.removeprefix("VERIFIER_").lower() in VerifierSettings.model_fields, (
                doc,
                name,
            )
        for name in re.findall(r"\bDRAFTER_[A-Z0-9_]+\b", text):
            assert name in drafter_variables, (doc, name)
        pattern = r"`((?:server|drafter|scripts|tests|docs|deploy|models)/[\w./-]*\w)(?:::\w+)?`"
        for path in re.findall(pattern, text):
            assert (REPO_ROOT / path).exists(), (doc, path)
        for link in re.findall(r"\]\(([^)#:]+)\)", text):
            assert (doc.parent / link).exists(), (doc, link)


def test_the_readme_is_short_and_the_docs_describe_the_software_not_its_history():
    assert len((REPO_ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            assert not LOG_BOOK.search(line), f"{doc.name}:{number}: {line}"
