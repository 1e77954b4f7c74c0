#!/usr/bin/env python3
"""Bystanders under attack: alice's latency alone and while mallory, with another API key,
runs each attack. A table, not a test.

Each attack gets a fresh verifier on 127.0.0.1 with two keys (alice-key, mallory-key),
and alice's measure is taken alone first, then with the attack under way. Alice runs one
session of one-token rounds back to back (each drafts the verifier's own next token,
taken from its /generate beforehand; an empty draft once her text leaves it) and her
client-side round latency is timed. The attacks:

  long-drafts          3 of mallory's sessions send 16-token drafts of a token the verifier
                       never picks, back to back.
  rejected-drafts      3 of mallory's sessions send 2-token drafts, always rejected; the
                       table adds the share of alice's rounds advised a draft of 0.
  count-tokens-flood   a `serve` in front of the verifier (verifier key alice-key); 6 of
                       mallory's connections post 4 MB texts (five turns) to
                       /v1/messages/count_tokens again and again; alice times chat
                       completions through that serve (whole requests) and a poller
                       times its GET /health.
  grammar              2 of mallory's connections open sessions with a GBNF grammar of
                       1,600 chained rules (a new one each time, so none is cached), and
                       alice times her prefills under a small JSON schema.

Every measure stops at its count or at --seconds, whichever comes first; every process
started here is stopped at the end, whatever happens.

    .venv/bin/python scripts/bystanders.py
    .venv/bin/python scripts/bystanders.py --attacks long-drafts --rounds 100
    .venv/bin/python scripts/bystanders.py --source /tmp/old-checkout   # before/after
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import shlex
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402

from scripts.harness.cli import HelpFormatter, first_paragraph  # noqa: E402
from scripts.harness.local import LocalServe, LocalVerifier  # noqa: E402
from server.shared.defaults import DEFAULT_VERIFIER_MODEL  # noqa: E402

ALICE, MALLORY = "alice-key", "mallory-key"
SERVE_KEYS = ("alice-serve-key", "mallory-serve-key")
ATTACKS = ("long-drafts", "rejected-drafts", "count-tokens-flood", "grammar")
ALICE_PROMPT = "Once upon a time, in a village"  # 256 tokens and more of the verifier's
MALLORY_PROMPT = "The history of the bicycle begins"
REFERENCE_TOKENS = 256  # alice's session is opened again once her rounds pass this
N_CTX = 2048  # a setting both this verifier and older ones know (the old default)
MALLORY_SESSIONS = 3
FLOOD_CONNECTIONS = 6
FLOOD_MB = 4.0  # the text of each count_tokens request: just under serve's 4 MiB body
TURN = 800_000  # characters a message: serve's longest is 1 MiB; five turns, the last a user's
GRAMMAR_CONNECTIONS = 2
GRAMMAR_RULES = 1600
ALICE_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank q-quantile (q = 1: the largest); NaN for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class Row:
    attack: str
    measure: str
    ms: list[float]
    notes: str = ""


@dataclass
class Tally:
    """What one side's requests were answered, shared by its threads."""

    statuses: Counter = field(default_factory=Counter)
    ms: list[float] = field(default_factory=list)
    accepted: int = 0
    drafted: int = 0
    verified: int = 0  # of the drafted tokens, those the verifier verified (draft_verified)
    lock: threading.Lock = field(default_factory=threading.Lock)

    said: dict = field(default_factory=dict)  # an error status's first type

    def add(self, status: int | str, ms: float | None = None, answer=None) -> None:
        with self.lock:
            self.statuses[status] += 1
            if ms is not None:
                self.ms.append(ms)
            if answer is not None and answer.status_code >= 400 and status not in self.said:
                self.said[status] = error_type(answer)

    def answered(self) -> str:
        return (
            ", ".join(
                f"{k}{f' {self.said[k]}' if k in self.said else ''}: {v}"
                for k, v in sorted(self.statuses.items(), key=str)
            )
            or "-"
        )


def error_type(answer: httpx.Response) -> str:
    """An error answer's type and the start of its message (either API's shape), or the
    start of its body."""
    try:
        error = answer.json().get("error") or {}
        what = f"{error.get('type') or error.get('code') or ''} {error.get('message') or ''}"
        return f"({what.strip()[:70]})"
    except ValueError:
        return f"({answer.text[:70]})"


def status_of(error: Exception) -> str:
    return type(error).__name__


# --- alice ------------------------------------------------------------------------------


def reference(url: str) -> list[int]:
    """The verifier's own continuation of alice's prompt: what her drafts are."""
    with httpx.Client(base_url=url, timeout=600, headers=auth(ALICE)) as client:
        answer = client.post("/generate", json={"prompt": ALICE_PROMPT, "max_tokens": 256})
        answer.raise_for_status()
        tokens = answer.json()["tokens"]
    if len(tokens) < 16:
        raise RuntimeError(f"the verifier ends alice's prompt after {len(tokens)} tokens")
    return tokens


@dataclass
class AliceRounds:
    ms: list[float] = field(default_factory=list)
    advised: list[int | None] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)

    def advised_zero(self) -> str:
        known = [a for a in self.advised if a is not None]
        if not known:
            return "advised: not given"
        zero = sum(a == 0 for a in known) / len(known)
        spread = Counter(known)
        common = ", ".join(f"{k}: {v}" for k, v in sorted(spread.items())[:6])
        return f"advised 0 in {zero:.0%} of rounds ({common})"


def alice_rounds(url: str, ref: list[int], rounds: int, seconds: float) -> AliceRounds:
    """Alice's one-token rounds back to back, `rounds` of them or for `seconds`."""
    out = AliceRounds()
    deadline = time.monotonic() + seconds
    session: str | None = None
    with httpx.Client(base_url=url, timeout=120, headers=auth(ALICE)) as client:

        def close() -> None:
            if session is not None:
                with contextlib.suppress(httpx.HTTPError):
                    client.delete(f"/sessions/{session}")

        try:
            while len(out.ms) < rounds and time.monotonic() < deadline:
                if session is None:
                    opened = client.post("/prefill", json={"prompt": ALICE_PROMPT})
                    if opened.status_code != 200:
                        out.errors[f"prefill {opened.status_code}"] += 1
                        time.sleep(0.05)
                        continue
                    opened_body = opened.json()
                    session, n_past = opened_body["session_id"], opened_body["total_tokens"]
                    made: list[int] = []
                at = len(made)
                if at >= min(len(ref), REFERENCE_TOKENS) - 1:
                    close()
                    session = None
                    continue
                draft = [ref[at]] if made == ref[:at] else []
                began = time.perf_counter()
                answer = client.post(
                    "/verify",
                    json={"session_id": session, "n_past": n_past, "draft_tokens": draft},
                )
                took = (time.perf_counter() - began) * 1000.0
                if answer.status_code != 200:
                    out.errors[f"verify {answer.status_code}"] += 1
                    close()
                    session = None
                    time.sleep(0.05)
                    continue
                body = answer.json()
                out.ms.append(took)
                out.advised.append(body.get("advised_draft"))
                made += body["tokens"]
                n_past = body["total_tokens"]
                if body["eos"]:
                    close()
                    session = None
        finally:
            close()
    return out


def timed_requests(
    send: Callable[[], httpx.Response], count: int, seconds: float, after=None
) -> tuple[list[float], Counter]:
    """`send` `count` times (or for `seconds`): the latencies of its 200s, every status."""
    ms: list[float] = []
    statuses: Counter = Counter()
    deadline = time.monotonic() + seconds
    while len(ms) < count and time.monotonic() < deadline:
        began = time.perf_counter()
        try:
            answer = send()
        except httpx.HTTPError as exc:
            statuses[status_of(exc)] += 1
            time.sleep(0.05)
            continue
        took = (time.perf_counter() - began) * 1000.0
        statuses[answer.status_code] += 1
        if answer.status_code == 200:
            ms.append(took)
            if after is not None:
                after(answer)
        else:
            time.sleep(0.05)
    return ms, statuses


# --- mallory ----------------------------------------------------------------------------


class Attacker(threading.Thread):
    """One of mallory's connections, repeating its attack until told to stop."""

    def __init__(self, url: str, stop: threading.Event, tally: Tally, offset: int = 0):
        super().__init__(daemon=True)
        self.url, self.stop_event, self.tally, self.offset = url, stop, tally, offset

    def run(self) -> None:
        try:
            self.attack()
        except Exception as exc:  # noted in the table; the measure goes on
            self.tally.add(f"ended: {status_of(exc)}")

    def attack(self) -> None:
        raise NotImplementedError


class DraftRounds(Attacker):
    """A session of mallory's sending `k`-token drafts of `token` back to back."""

    def __init__(self, url: str, stop: threading.Event, tally: Tally, k: int, token: int):
        super().__init__(url, stop, tally)
        self.k, self.token = k, token

    def attack(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120, headers=auth(MALLORY)) as client:
            while not self.stop_event.is_set():
                opened = client.post("/prefill", json={"prompt": MALLORY_PROMPT})
                if opened.status_code != 200:
                    self.tally.add(f"prefill {opened.status_code}", answer=opened)
                    time.sleep(0.05)
                    continue
                session, n_past = opened.json()["session_id"], opened.json()["total_tokens"]
                while not self.stop_event.is_set() and n_past + self.k + 2 < N_CTX:
                    answer = client.post(
                        "/verify",
                        json={
                            "session_id": session,
                            "n_past": n_past,
                            "draft_tokens": [self.token] * self.k,
                        },
                    )
                    self.tally.add(answer.status_code, answer=answer)
                    if answer.status_code != 200:
                        break
                    body = answer.json()
                    with self.tally.lock:
                        self.tally.accepted += body["accepted_prefix_len"]
                        self.tally.drafted += self.k
                        verified = body.get("draft_verified")
                        self.tally.verified += self.k if verified is None else verified
                    n_past = body["total_tokens"]
                    if body["eos"]:
                        break
                client.delete(f"/sessions/{session}")


def chained_gbnf(rules: int, n: int) -> str:
    """A GBNF grammar of `rules` rules, each the next one's only way in (a chain), its
    last literal `n`'s, so that no two are the same grammar."""
    lines = ["root ::= r0"]
    lines += [f'r{i} ::= "a" r{i + 1}' for i in range(rules - 1)]
    lines.append(f'r{rules - 1} ::= "z{n}"')
    return "\n".join(lines) + "\n"


class GrammarPrefills(Attacker):
    """Mallory's prefills, each under a new chained GBNF grammar."""

    def attack(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120, headers=auth(MALLORY)) as client:
            n = self.offset
            while not self.stop_event.is_set():
                n += GRAMMAR_CONNECTIONS
                body = {
                    "prompt": "x",
                    "grammar": {"kind": "gbnf", "source": chained_gbnf(GRAMMAR_RULES, n)},
                }
                began = time.perf_counter()
                try:
                    opened = client.post("/prefill", json=body)
                except httpx.HTTPError as exc:
                    self.tally.add(status_of(exc))
                    time.sleep(0.2)
                    continue
                self.tally.add(opened.status_code, (time.perf_counter() - began) * 1000.0, opened)
                if opened.status_code == 200:
                    client.delete(f"/sessions/{opened.json()['session_id']}")
                else:
                    time.sleep(0.05)


class CountTokens(Attacker):
    """Mallory's 4 MB texts to serve's /v1/messages/count_tokens, one after another."""

    def __init__(self, url: str, stop: threading.Event, tally: Tally, text: str, key: str):
        super().__init__(url, stop, tally)
        self.text, self.key = text, key

    def attack(self) -> None:
        # In turns: serve takes at most 1 MiB of characters in one message (a 400 before
        # any work), and a body of 4 MiB.
        turns = [
            {"role": "user" if n % 2 == 0 else "assistant", "content": self.text[i : i + TURN]}
            for n, i in enumerate(range(0, len(self.text), TURN))
        ]
        body = {"model": "any", "messages": turns}
        with httpx.Client(timeout=300, headers=auth(self.key)) as client:
            while not self.stop_event.is_set():
                began = time.perf_counter()
                try:
                    answer = client.post(f"{self.url}/messages/count_tokens", json=body)
                except httpx.HTTPError as exc:
                    self.tally.add(status_of(exc))
                    time.sleep(0.2)
                    continue
                self.tally.add(answer.status_code, (time.perf_counter() - began) * 1000.0, answer)


def under(attackers: list[Attacker], stop: threading.Event, measure: Callable[[], object]):
    """`measure()` while `attackers` run (under way for a second first); they are stopped
    and waited for (up to a minute) whatever happens."""
    for attacker in attackers:
        attacker.start()
    try:
        time.sleep(1.0)
        return measure()
    finally:
        stop.set()
        for attacker in attackers:
            attacker.join(timeout=60)


# --- the runs ---------------------------------------------------------------------------


@dataclass
class Setup:
    source: Path | None
    threads: int
    rounds: int
    requests: int
    seconds: float

    @property
    def root(self) -> Path:
        return self.source or REPO_ROOT

    def verifier(self) -> LocalVerifier:
        env = {
            "VERIFIER_MODEL_PATH": str(DEFAULT_VERIFIER_MODEL),
            "VERIFIER_API_KEYS": f"{ALICE},{MALLORY}",
            "VERIFIER_N_THREADS": str(self.threads),
            "VERIFIER_N_CTX": str(N_CTX),
            "VERIFIER_MAX_GENERATE_TOKENS": str(REFERENCE_TOKENS),
        }
        verifier = LocalVerifier(env, source=self.source)
        try:
            verifier.wait_ready(timeout=600)
        except Exception:
            verifier.stop()
            raise
        return verifier


def died(verifier: LocalVerifier) -> str:
    code = verifier.process.poll()
    return "" if code is None else f"; THE VERIFIER ENDED ({code})"


def rounds_attack(setup: Setup, attack: str) -> list[Row]:
    verifier = setup.verifier()
    try:
        url = verifier.url
        with httpx.Client(base_url=url, timeout=60, headers=auth(ALICE)) as client:
            n_vocab = client.get("/info").json()["n_vocab"]
        ref = reference(url)
        alone = alice_rounds(url, ref, setup.rounds, setup.seconds)
        tally, stop = Tally(), threading.Event()
        k = 16 if attack == "long-drafts" else 2
        # The last id: a token no greedy pass picks here (a rare piece of the vocabulary).
        mallory = [DraftRounds(url, stop, tally, k, n_vocab - 1) for _ in range(MALLORY_SESSIONS)]
        during = under(mallory, stop, lambda: alice_rounds(url, ref, setup.rounds, setup.seconds))
        accepted = (
            f"{tally.accepted}/{tally.drafted} draft tokens accepted, {tally.verified} verified"
        )
        what = "alice's one-token rounds"
        rows = [
            Row("(alone)", what, alone.ms, alone.advised_zero() + errors(alone.errors)),
            Row(
                attack,
                what,
                during.ms,
                f"{during.advised_zero()}{errors(during.errors)}; mallory: "
                f"{tally.answered()}, {accepted}{died(verifier)}",
            ),
        ]
        return rows
    finally:
        verifier.stop()


def errors(counts: Counter) -> str:
    return f"; alice's errors: {dict(counts)}" if counts else ""


def serve_keys(root: Path) -> tuple[str, str, str]:
    """`--serve-api-key`'s value and alice's and mallory's keys: one each where that
    checkout's serve takes several keys (drafter/principals.py), else one for both."""
    if (root / "drafter" / "principals.py").exists():
        return ",".join(SERVE_KEYS), SERVE_KEYS[0], SERVE_KEYS[1]
    return SERVE_KEYS[0], SERVE_KEYS[0], SERVE_KEYS[0]


def count_tokens_attack(setup: Setup) -> list[Row]:
    verifier = setup.verifier()
    serve = None
    try:
        given, alice_key, mallory_key = serve_keys(setup.root)
        serve = LocalServe(
            verifier.url,
            "--api-key",
            ALICE,
            "--serve-api-key",
            given,
            threads=setup.threads,
            # the script file run by this interpreter, its code from the checkout measured
            command_prefix=[sys.executable],
            env={"PYTHONPATH": str(setup.root)},
            loaded=True,
            timeout=600,
        )
        chat_body = {
            "model": "any",
            "messages": [{"role": "user", "content": "Name one colour."}],
            "max_tokens": 8,
            "temperature": 0,
        }
        health_url = serve.url.removesuffix("/v1") + "/health"
        with httpx.Client(timeout=300, headers=auth(alice_key)) as client:

            def chat() -> httpx.Response:
                return client.post(f"{serve.url}/chat/completions", json=chat_body)

            def measure() -> tuple[list[float], Counter, list[float]]:
                health: list[float] = []
                done = threading.Event()

                def poll() -> None:
                    with httpx.Client(timeout=300) as probe:
                        while not done.is_set():
                            began = time.perf_counter()
                            try:
                                probe.get(health_url)
                                health.append((time.perf_counter() - began) * 1000.0)
                            except httpx.HTTPError:
                                health.append(math.inf)
                            time.sleep(0.05)

                poller = threading.Thread(target=poll, daemon=True)
                poller.start()
                try:
                    ms, statuses = timed_requests(chat, setup.requests, setup.seconds)
                finally:
                    done.set()
                    poller.join(timeout=300)
                return ms, statuses, health

            chat()  # the first request's own costs (a session's first prefill) left out
            alone_ms, alone_statuses, alone_health = measure()
            tally, stop = Tally(), threading.Event()
            text = lorem(int(FLOOD_MB * 1_000_000))
            mallory = [
                CountTokens(serve.url, stop, tally, text, mallory_key)
                for _ in range(FLOOD_CONNECTIONS)
            ]
            ms, statuses, health = under(mallory, stop, measure)
        keys = "one serve key each" if alice_key != mallory_key else "one serve key for both"
        chat_what = "chat completion via serve (whole request, 8 tokens)"
        return [
            Row("(alone)", chat_what, alone_ms, f"answers: {dict(alone_statuses)}; {keys}"),
            Row(
                "(alone)",
                "serve's GET /health",
                alone_health,
                f"max {quantile(alone_health, 1.0):.1f} ms",
            ),
            Row(
                "count-tokens-flood",
                chat_what,
                ms,
                f"answers: {dict(statuses)}; mallory: {tally.answered()}, her p50 "
                f"{quantile(tally.ms, 0.5):.0f} ms{died(verifier)}",
            ),
            Row(
                "count-tokens-flood",
                "serve's GET /health",
                health,
                f"max {quantile(health, 1.0):.1f} ms",
            ),
        ]
    finally:
        if serve is not None:
            serve.stop()
        verifier.stop()


def lorem(chars: int) -> str:
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum "
    return (words * (chars // len(words) + 1))[:chars]


def grammar_attack(setup: Setup) -> list[Row]:
    verifier = setup.verifier()
    try:
        url = verifier.url
        body = {
            "prompt": "Give one person as JSON:",
            "grammar": {"kind": "json_schema", "source": ALICE_SCHEMA},
        }
        with httpx.Client(base_url=url, timeout=300, headers=auth(ALICE)) as client:

            def prefill() -> httpx.Response:
                return client.post("/prefill", json=body)

            def end(answer: httpx.Response) -> None:
                client.delete(f"/sessions/{answer.json()['session_id']}")

            def measure() -> tuple[list[float], Counter]:
                return timed_requests(prefill, setup.requests, setup.seconds, after=end)

            end(prefill())  # the schema's first compile left out (later ones are copies)
            alone_ms, alone_statuses = measure()
            tally, stop = Tally(), threading.Event()
            mallory = [GrammarPrefills(url, stop, tally, i) for i in range(GRAMMAR_CONNECTIONS)]
            ms, statuses = under(mallory, stop, measure)
        size = len(chained_gbnf(GRAMMAR_RULES, 0))
        what = "alice's prefill under a small JSON schema"
        return [
            Row("(alone)", what, alone_ms, f"answers: {dict(alone_statuses)}"),
            Row(
                "grammar",
                what,
                ms,
                f"answers: {dict(statuses)}; mallory ({GRAMMAR_RULES} chained GBNF rules, "
                f"{size} characters): {tally.answered()}, her p50 "
                f"{quantile(tally.ms, 0.5):.0f} ms{died(verifier)}",
            ),
        ]
    finally:
        verifier.stop()


def commit(root: Path) -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        return done.stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "server", "drafter")
    return f"{head}{' (with uncommitted changes in server/ or drafter/)' if dirty else ''}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=first_paragraph(__doc__), formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--attacks",
        default=",".join(ATTACKS),
        help=f"The attacks to run, comma-separated, of: {', '.join(ATTACKS)}.",
    )
    parser.add_argument(
        "--rounds", type=int, default=200, help="Alice's verify rounds timed per measure."
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=30,
        help="Alice's chat completions (count-tokens-flood) or prefills (grammar) timed per "
        "measure.",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=45.0,
        help="Longest time one measure takes (alone or under an attack), whatever is left "
        "of its rounds or requests.",
    )
    parser.add_argument(
        "--source",
        type=Path,
        help="Another checkout of this repository whose verifier (and serve) to run, for "
        "before/after tables; None: this checkout's.",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="The verifier's CPU threads (VERIFIER_N_THREADS), and serve's.",
    )
    args = parser.parse_args()
    attacks = [a.strip() for a in args.attacks.split(",") if a.strip()]
    unknown = [a for a in attacks if a not in ATTACKS]
    if unknown:
        parser.error(f"unknown attacks {unknown}; known: {', '.join(ATTACKS)}")
    source = args.source.resolve() if args.source else None
    setup = Setup(source, args.threads, args.rounds, args.requests, args.seconds)

    rows: list[Row] = []
    for attack in attacks:
        print(f"running {attack} ...", file=sys.stderr, flush=True)
        if attack == "count-tokens-flood":
            rows += count_tokens_attack(setup)
        elif attack == "grammar":
            rows += grammar_attack(setup)
        else:
            rows += rounds_attack(setup, attack)

    print(f"command: {shlex.join([Path(sys.executable).name, *sys.argv])}")
    print(f"commit: {commit(REPO_ROOT)}", end="")
    print(f"; verifier and serve from {source} at {commit(source)}" if source else "")
    print(
        f"date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; verifier: "
        f"{DEFAULT_VERIFIER_MODEL.name}, VERIFIER_N_THREADS={args.threads}, "
        f"VERIFIER_N_CTX={N_CTX}, keys {ALICE} and {MALLORY}; each attack on a fresh verifier"
    )
    print()
    print("| attack | bystander measure | n | p50 ms | p99 ms | notes |")
    print("|---|---|---:|---:|---:|---|")
    for row in rows:
        print(
            f"| {row.attack} | {row.measure} | {len(row.ms)} | {quantile(row.ms, 0.5):.1f} "
            f"| {quantile(row.ms, 0.99):.1f} | {row.notes} |"
        )


if __name__ == "__main__":
    main()
