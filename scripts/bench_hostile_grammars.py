#!/usr/bin/env python3
"""A bystander beside hostile grammars: a table, not a test.

Starts a verifier with two keys, alice and mallory (or uses --server, whose keys are
given). Alice opens sessions from text prompts and runs rounds of one token; mallory,
in two threads, runs one attack at a time: an ambiguous Lark grammar with chunk rounds
or with 16-token drafts, nested counted repetition (a new regex each time), or JSON
schemas slow to compile (a new one each time); and, to tell a grammar's cost from the cost
of rounds that size, the same chunk and draft rounds without a grammar. Per attack:
alice's round latency (p50, p99), her tokens per second, her prompt's time to open a
session (p50), what mallory's requests were answered, and the verifier's resident memory
before and after.

    .venv/bin/python scripts/bench_hostile_grammars.py --seconds 15
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.harness.local import LocalVerifier
from server.shared.defaults import DEFAULT_VERIFIER_MODEL

ALICE, MALLORY = "alice-bench-key-0123456789", "mallory-bench-key-0123456789"
AMBIGUOUS = 'start: x\nx: x x | x x x | "a" | "b" | " "'
ALICE_PROMPT = "Write one sentence about the sea."


def slow_schema(n: int) -> dict:
    return {"type": "object", "patternProperties": {f"^p{n}_{i}[a-z]*$": {} for i in range(500)}}


def mallory_requests(kind: str, n: int) -> tuple[dict, dict]:
    """An attack's prefill body and how its rounds go (the n-th try)."""
    if kind == "ambiguous-chunks":
        return {"prompt": "x", "grammar": {"kind": "lark", "source": AMBIGUOUS}}, {"chunk": 16}
    if kind == "ambiguous-drafts":
        return {"prompt": "x", "grammar": {"kind": "lark", "source": AMBIGUOUS}}, {"draft": 16}
    if kind == "plain-chunks":  # the same rounds without a grammar: what their size costs
        return {"prompt": "x"}, {"chunk": 16}
    if kind == "plain-drafts":
        return {"prompt": "x"}, {"draft": 16}
    if kind == "nested-repetition":
        grammar = {"kind": "regex", "source": f"((a{{1000}}){{1000}}){{1000}}x{n}"}
        return {"prompt": "x", "grammar": grammar}, {"chunk": 4}
    grammar = {"kind": "json_schema", "source": slow_schema(n)}
    return {"prompt": "x", "grammar": grammar}, {"chunk": 4}


def key(k: str) -> dict[str, str]:
    return {"X-API-Key": k}


class Mallory(threading.Thread):
    def __init__(self, url: str, kind: str, offset: int, stop: threading.Event):
        super().__init__(daemon=True)
        self.url, self.kind, self.offset, self.stop_event = url, kind, offset, stop
        self.statuses: Counter[int] = Counter()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=600) as client:
            n = self.offset
            while not self.stop_event.is_set():
                n += 2
                body, how = mallory_requests(self.kind, n)
                opened = client.post("/prefill", json=body, headers=key(MALLORY))
                self.statuses[opened.status_code] += 1
                if opened.status_code != 200:
                    time.sleep(0.05)
                    continue
                session = opened.json()
                n_past, last = session["total_tokens"], []
                for _ in range(8):
                    if self.stop_event.is_set():
                        break
                    step = {"session_id": session["session_id"], "n_past": n_past}
                    if "draft" in how and last:  # the grammar's own tokens, again: accepted
                        step["draft_tokens"] = (last * how["draft"])[: how["draft"]]
                    else:
                        step["chunk_tokens"] = how.get("chunk", 16)
                    answer = client.post("/verify", json=step, headers=key(MALLORY))
                    self.statuses[answer.status_code] += 1
                    if answer.status_code != 200 or answer.json()["eos"]:
                        break
                    n_past, last = answer.json()["total_tokens"], answer.json()["tokens"]
                client.delete(f"/sessions/{session['session_id']}", headers=key(MALLORY))


def alice(url: str, seconds: float) -> tuple[list[float], list[float], int, float]:
    """Round latencies (ms), prefill latencies (ms), tokens, seconds taken."""
    rounds, prefills, tokens = [], [], 0
    began = time.perf_counter()
    with httpx.Client(base_url=url, timeout=600) as client:
        while time.perf_counter() - began < seconds:
            t = time.perf_counter()
            opened = client.post("/prefill", json={"prompt": ALICE_PROMPT}, headers=key(ALICE))
            prefills.append((time.perf_counter() - t) * 1000)
            session = opened.json()
            n_past = session["total_tokens"]
            for _ in range(32):
                t = time.perf_counter()
                step = {"session_id": session["session_id"], "n_past": n_past}
                answer = client.post("/verify", json=step, headers=key(ALICE))
                rounds.append((time.perf_counter() - t) * 1000)
                answer.raise_for_status()
                tokens += len(answer.json()["tokens"])
                n_past = answer.json()["total_tokens"]
                if answer.json()["eos"]:
                    break
            client.delete(f"/sessions/{session['session_id']}", headers=key(ALICE))
    return rounds, prefills, tokens, time.perf_counter() - began


def resident_mb(pid: int | None) -> str:
    if pid is None:
        return "-"
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return f"{int(line.split()[1]) / 1024:.0f}"
    return "-"


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def run(url: str, pid: int | None, seconds: float, attacks: list[str]) -> None:
    print(f"alice: rounds of one token; mallory: two threads; {seconds:g} s each")
    print(
        "| mallory | alice round p50 ms | p99 ms | alice tok/s | alice prefill p50 ms "
        "| mallory's answers | RSS MB before | after |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    for attack in ["(none)", *attacks]:
        before = resident_mb(pid)
        stop = threading.Event()
        threads = [] if attack == "(none)" else [Mallory(url, attack, i, stop) for i in (0, 1)]
        for thread in threads:
            thread.start()
        time.sleep(1.0 if threads else 0.0)  # the attack under way first
        rounds, prefills, tokens, took = alice(url, seconds)
        stop.set()
        for thread in threads:
            thread.join()
        answers = sum((t.statuses for t in threads), Counter())
        print(
            f"| {attack} | {p(rounds, 50):.1f} | {p(rounds, 99):.1f} | {tokens / took:.1f} "
            f"| {p(prefills, 50):.1f} | {dict(sorted(answers.items())) or '-'} "
            f"| {before} | {resident_mb(pid)} |"
        )


ATTACKS = [
    "plain-chunks",
    "ambiguous-chunks",
    "plain-drafts",
    "ambiguous-drafts",
    "nested-repetition",
    "slow-compiles",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--server", help="a running verifier with the keys alice and mallory")
    parser.add_argument("--seconds", type=float, default=15.0, help="alice's time per attack")
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated")
    parser.add_argument("--threads", type=int, default=1, help="the verifier's threads")
    parser.add_argument("--source", type=Path, help="another checkout whose verifier to run")
    args = parser.parse_args()
    attacks = [a for a in args.attacks.split(",") if a]
    if args.server:
        run(args.server, None, args.seconds, attacks)
        return
    env = {
        "VERIFIER_MODEL_PATH": str(DEFAULT_VERIFIER_MODEL),
        "VERIFIER_API_KEYS": f"{ALICE},{MALLORY}",
        "VERIFIER_MAX_SESSIONS": "6",
        "VERIFIER_MAX_DRAFT": "16",
        "VERIFIER_N_THREADS": str(args.threads),
    }
    with LocalVerifier(env, source=args.source) as verifier:
        run(verifier.url, verifier.process.pid, args.seconds, attacks)


if __name__ == "__main__":
    main()
