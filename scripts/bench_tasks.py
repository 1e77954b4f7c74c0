#!/usr/bin/env python3
"""Spec-Bench's six task families through `serve` and the verifier alone, and through
llama.cpp's own `llama-server` when one is given: tokens per second of wall time per
family, Spec-Bench's mean accepted tokens, and whether every greedy answer of ours equals
the verifier alone's. A table, not a test (its --quick form runs in the suite).

The questions are the repository's own copy of Spec-Bench (`scripts/data/spec_bench/`:
every other question of each category, its source and license). Two more families, not
run unless named, ask HumanEval's problems (`scripts/data/humaneval/`) as sessions where
text repeats across requests: `code_fix` (complete a function, then fix it and give the
whole function again) and `agent_edit` (complete it, then read it back as a file an agent
wrote, `read_file("src/solution.py")`, rename it, and give the whole file again). Chat
completions, greedy (temperature 0), up to --max-tokens tokens an answer; a multi-turn
question is sent as two turns, the second carrying the first turn's answer, as a chat app
sends it. Every question
goes through every system before the next question (the systems' order turns by one each
question), so that a machine whose speed drifts slows them alike; a question goes out once
no verifier has idle work under way (a cached prefix evaluated again: all the verifiers
share a core, so one system's idle work would slow the next system's request), and its
turns follow one another at once. Each system of ours has a verifier of its own, pinned
to --verifier-core, and its `serve` pinned to --drafter-core; llama-server (both models
in one process) may use both cores (--llama-one-core: the verifiers' core alone, its HTTP
thread beside its decoding as a verifier's is). One thread per model.

Systems (--systems):

- `verifier`: the verifier alone, decoding on its own (POST /generate, the prompt rendered
  with the model's chat template as `serve` renders it); no drafting, no HTTP per token;
- `default`: `serve` as installed; `ngram`: `serve --drafter ngram` (prompt lookup);
  `model+ngram`: `serve --drafter model+ngram`; `suffix`, `model+suffix`,
  `model+history`: the suffix drafter over the history of the run's earlier questions
  (one `serve` answers them all); `model`: `serve --drafter model`;
  `k4`: `serve --draft-n 4` (the draft model, a fixed four tokens a round); `k0`:
  `serve --draft-n 0` (no drafting asked for);
- with --llama-server: `llama` (plain decoding), `llama-md` (`-md` with the draft model and
  `--spec-type draft-simple`: `-md` alone loads the model and drafts nothing in this
  llama.cpp), `llama-ngram` (`--spec-type ngram-simple`), `llama-ngram-mod`,
  `llama-ngram-cache` (`--spec-type ngram-mod`, `ngram-cache`), `llama-ngram-mod-62`
  (`ngram-mod` with `--spec-ngram-mod-n-max 62`: its passes stay below the tile of 64
  rows). llama-server renders its chat template with Jinja by default (SmolLM2's adds a
  system prompt ours has not: compare tokens per second, not texts);
  `--llama-args=--no-jinja` makes it render as ours does.

Tokens per second: generated tokens over the wall seconds of a family's requests, as the
client saw them (prompt evaluation included). Mean accepted tokens (Spec-Bench's figure,
tokens a verifier pass commits): generated tokens / (generated tokens - accepted draft
tokens), from `serve`'s `speculative` figures and the verifier's count of the copies it
made in chunks and kept (`verifier_copied_tokens_accepted_total`), and llama-server's
`timings`. Acceptance by kind of draft (a draft model's, a lookup's, the verifier's own
copies): the draft tokens accepted of those drafted, from each verifier's counts
(`/metrics`) before and after each request.

    .venv/bin/python scripts/bench_tasks.py --per-family 5
    .venv/bin/python scripts/bench_tasks.py --llama-server build/llama-server/bin/llama-server
    .venv/bin/python scripts/bench_tasks.py --quick                 # the smoke run the tests run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from scripts.harness.cli import HelpFormatter, first_paragraph  # noqa: E402
from scripts.harness.local import (  # noqa: E402
    LocalServe,
    LocalVerifier,
    free_port,
    stop_process,
    wait_healthy,
)
from scripts.harness.metrics import Metrics  # noqa: E402
from server.shared.defaults import DEFAULT_DRAFTER_MODEL, DEFAULT_VERIFIER_MODEL  # noqa: E402

QUESTIONS = REPO_ROOT / "scripts" / "data" / "spec_bench" / "spec_bench_dev.jsonl"
# Spec-Bench's six families, in its order; multi-turn conversation is MT-Bench's eight
# categories, every other family one category of the same name.
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem")
MT_BENCH += ("humanities",)
FAMILIES = {
    "mt_bench": "multi-turn (MT-Bench)",
    "translation": "translation",
    "summarization": "summarization",
    "qa": "question answering",
    "math_reasoning": "math reasoning",
    "rag": "retrieval-augmented",
}
# Sessions where text repeats across requests (not in the default run): HumanEval's
# problems, the second turn carrying the first answer back or asking for it again.
HUMANEVAL = REPO_ROOT / "scripts" / "data" / "humaneval" / "humaneval.jsonl"
REPEATS = {"code_fix": "code fix (HumanEval)", "agent_edit": "agent edit (HumanEval)"}
FIRST_TURN = (
    "Complete this Python function. Reply with the whole function in one code block.\n\n"
    "```python\n{prompt}```"
)
SECOND_TURN = {
    "code_fix": "It fails on an empty input. Fix that, and reply with the whole function "
    "again in one code block.",
    # {previous}: the first answer, as the file the agent saved it to reads back.
    "agent_edit": 'I saved your answer to src/solution.py. read_file("src/solution.py") returned:'
    "\n\n{previous}\n\nRename `{entry_point}` to `solve` everywhere and reply with the "
    "whole file.",
}
LABELS = {**FAMILIES, **REPEATS}
WARM_UP = [{"role": "user", "content": "Say hello."}]
# Idle work is over once this counter has stood still this long: longer than the
# verifier's quiet moment before a piece (VERIFIER_IDLE_RETILE_AFTER_S) and a piece.
RETILED_METRIC = "verifier_prompt_tokens_retiled_total"
# Draft tokens by kind, as the verifier counts them (drafted, accepted): every client
# draft, of those a client's lookups (`draft_kind`), and the verifier's own copies in chunks.
DRAFT_METRICS = {
    "client": ("verifier_drafted_tokens_total", "verifier_accepted_tokens_total"),
    "lookup": ("verifier_lookup_drafted_tokens_total", "verifier_lookup_accepted_tokens_total"),
    "copies": ("verifier_copied_tokens_total", "verifier_copied_tokens_accepted_total"),
}
KINDS = ("model", "lookup", "copies")
SETTLED_S = 1.5
SETTLE_AT_MOST_S = 60.0


@dataclass(frozen=True)
class System:
    name: str
    label: str
    kind: str  # "generate" (the verifier alone), "serve" or "llama"
    args: tuple[str, ...] = ()
    speculative: bool = True  # whether it drafts (a mean accepted tokens column)
    verifier_env: tuple[tuple[str, str], ...] = ()  # settings of its verifier (--variant)


OURS = (
    System("verifier", "verifier alone", "generate", speculative=False),
    System("default", "ours, default", "serve"),
    System("ngram", "ours, ngram", "serve", ("--drafter", "ngram")),
    System("model+ngram", "ours, model+ngram", "serve", ("--drafter", "model+ngram")),
    # One `serve` answers every question of a run: its history is the user's earlier ones.
    System("suffix", "ours, suffix", "serve", ("--drafter", "suffix")),
    System("model+suffix", "ours, model+suffix", "serve", ("--drafter", "model+suffix")),
    System("model+history", "ours, model+history", "serve", ("--drafter", "model+history")),
    System("model", "ours, model", "serve", ("--drafter", "model")),
    System("k4", "ours, k=4", "serve", ("--draft-n", "4")),
    System("k0", "ours, k=0", "serve", ("--draft-n", "0")),
)
LLAMA = (
    System("llama", "llama-server", "llama", speculative=False),
    # `-md` alone loads the draft model and drafts nothing: this llama.cpp's --spec-type is
    # "none" unless named (or read from a draft GGUF of a kind that says its own).
    System(
        "llama-md",
        "llama-server -md",
        "llama",
        ("-md", "{drafter}", "--spec-type", "draft-simple", "-td", "1", "-tbd", "1"),
    ),
    System("llama-ngram", "llama-server ngram-simple", "llama", ("--spec-type", "ngram-simple")),
    System("llama-ngram-mod", "llama-server ngram-mod", "llama", ("--spec-type", "ngram-mod")),
    # Drafts of at most 62 tokens: every pass below the tile of 64 rows, where a row's
    # logits are those of the row alone (docs/numerics.md), as ours are.
    System(
        "llama-ngram-mod-62",
        "llama-server ngram-mod, drafts <= 62",
        "llama",
        ("--spec-type", "ngram-mod", "--spec-ngram-mod-n-max", "62"),
    ),
    System(
        "llama-ngram-cache", "llama-server ngram-cache", "llama", ("--spec-type", "ngram-cache")
    ),
)
SYSTEMS = {s.name: s for s in OURS + LLAMA}
DEFAULT_SYSTEMS = "verifier,default,ngram,model+ngram,k4"
QUICK_SYSTEMS = "verifier,default,ngram"


@dataclass
class Question:
    id: int
    category: str
    family: str
    turns: list[str]


@dataclass
class Answer:
    text: str
    tokens: int
    seconds: float
    accepted: int | None = None  # draft tokens accepted; None: not reported
    extra: dict = field(default_factory=dict)


def humaneval_questions(family: str) -> list[Question]:
    """HumanEval's problems as two-turn sessions of `family` (REPEATS): numbered 1000 on
    for code_fix, 2000 on for agent_edit."""
    base = 1000 * (1 + list(REPEATS).index(family))
    questions = []
    for i, line in enumerate(HUMANEVAL.read_text().splitlines()):
        row = json.loads(line)
        second = SECOND_TURN[family].replace("{entry_point}", row["entry_point"])
        first = FIRST_TURN.replace("{prompt}", row["prompt"])
        questions.append(Question(base + i, family, family, [first, second]))
    return questions


def turn_text(text: str, messages: Sequence[dict]) -> str:
    """A turn as sent: `{previous}` is the last answer's text."""
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    return text.replace("{previous}", answers[-1] if answers else "")


def family_of(category: str) -> str:
    return "mt_bench" if category in MT_BENCH else category


def load_questions(families: Sequence[str], per_family: int | None) -> list[Question]:
    """The first `per_family` questions of each family (all: None), interleaved: one of each
    family in turn, so that every family sees the run's early and late minutes."""
    by_family: dict[str, list[Question]] = {f: [] for f in families}
    for line in QUESTIONS.read_text().splitlines():
        row = json.loads(line)
        family = family_of(row["category"])
        if family in by_family:
            by_family[family].append(
                Question(row["question_id"], row["category"], family, row["turns"])
            )
    for family in set(families) & set(REPEATS):
        by_family[family] = humaneval_questions(family)
    if per_family is not None:
        by_family = {f: qs[:per_family] for f, qs in by_family.items()}
    longest = max(len(qs) for qs in by_family.values())
    return [qs[i] for i in range(longest) for qs in by_family.values() if i < len(qs)]


def variant(text: str) -> System:
    """`NAME[@SYSTEM]:VAR=VALUE[,VAR=VALUE...]`: `serve`'s default (or SYSTEM, another of
    ours that runs `serve`) on a verifier with these settings, as a system named NAME (an
    A/B of a verifier setting in one run)."""
    named, _, settings = text.partition(":")
    name, _, base_name = named.partition("@")
    pairs = [p.strip().partition("=") for p in settings.split(",") if p.strip()]
    if not name or not pairs or any(not k.startswith("VERIFIER_") or not eq for k, eq, _ in pairs):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME[@SYSTEM]:VERIFIER_SETTING=VALUE[,VERIFIER_SETTING=VALUE...]"
        )
    if name in SYSTEMS:
        raise argparse.ArgumentTypeError(f"{text!r}: {name!r} is a system already")
    base = SYSTEMS.get(base_name or "default")
    if base is None or base.kind != "serve":
        serving = ", ".join(s.name for s in OURS if s.kind == "serve")
        raise argparse.ArgumentTypeError(f"{text!r}: SYSTEM is one of {serving}")
    env = tuple((k, v) for k, _, v in pairs)
    label = f"{base.label}, " + ", ".join(f"{k}={v}" for k, v in env)
    return System(name, label, "serve", base.args, verifier_env=env)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def pin(cores: Sequence[int | None]) -> list[str]:
    chosen = [str(c) for c in cores if c is not None]
    if not chosen or shutil.which("taskset") is None:
        return []
    return ["taskset", "-c", ",".join(chosen)]


def post_chat(
    client: httpx.Client, url: str, messages: list[dict], max_tokens: int
) -> tuple[dict, float]:
    """One chat completion: its reply, and the wall seconds the client waited for it."""
    began = time.perf_counter()
    response = client.post(url, json=chat_body(messages, max_tokens))
    seconds = time.perf_counter() - began
    response.raise_for_status()
    return response.json(), seconds


def chat_body(messages: list[dict], max_tokens: int) -> dict:
    return {"model": "any", "messages": messages, "max_tokens": max_tokens, "temperature": 0}


class Ours:
    """A verifier of its own and, for `serve` systems, `serve` in front of it."""

    def __init__(self, system: System, args: argparse.Namespace, vocab):
        self.system = system
        self.vocab = vocab
        self.verifier = LocalVerifier(
            {
                "VERIFIER_MODEL_PATH": str(args.verifier_model),
                "VERIFIER_N_THREADS": "1",
                "VERIFIER_N_CTX": str(args.n_ctx),
                **dict(system.verifier_env),
            },
            command_prefix=pin([args.verifier_core]),
        )
        self.serve = None
        try:
            self.verifier.wait_ready(timeout=300)
            if system.kind == "serve":
                self.serve = LocalServe(
                    self.verifier.url,
                    "--model",
                    str(args.drafter_model),
                    "--timeout",
                    "600",
                    *system.args,
                    threads=1,
                    command_prefix=pin([args.drafter_core]),
                    timeout=300,
                    loaded=True,  # llama-server too loads its models before it answers
                )
        except Exception:
            self.stop()
            raise
        self.client = httpx.Client(timeout=1800)

    def idle_work_done(self) -> str:
        """The verifier's count of tokens its idle work evaluated (a cached prefix
        evaluated again, a piece at a time after a quiet moment)."""
        text = self.client.get(f"{self.verifier.url}/metrics").text
        return "".join(ln for ln in text.splitlines() if ln.startswith(RETILED_METRIC))

    def draft_counts(self) -> dict[str, tuple[int, int]]:
        """The verifier's counts of draft tokens, drafted and accepted, by DRAFT_METRICS."""
        metrics = Metrics(self.client.get(f"{self.verifier.url}/metrics").text)
        return {
            kind: (int(metrics.value(drafted)), int(metrics.value(accepted)))
            for kind, (drafted, accepted) in DRAFT_METRICS.items()
        }

    def ask(self, messages: list[dict], max_tokens: int) -> Answer:
        if self.serve is None:
            return self._generate(messages, max_tokens)
        before = self.draft_counts()
        reply, seconds = post_chat(
            self.client, f"{self.serve.url}/chat/completions", messages, max_tokens
        )
        figures = reply.get("speculative") or {}
        kinds = by_kind(before, self.draft_counts())
        kept = ("rounds", "drafted", "tokens_per_round")
        return Answer(
            text=reply["choices"][0]["message"]["content"] or "",
            tokens=reply["usage"]["completion_tokens"],
            seconds=seconds,
            # A verifier pass commits a client's accepted drafts and its own copies alike.
            accepted=figures.get("accepted", 0) + kinds["copies"][1],
            extra={
                **{k: v for k, v in figures.items() if k in kept},
                "copies_accepted": kinds["copies"][1],
                "by_kind": kinds,
            },
        )

    def _generate(self, messages: list[dict], max_tokens: int) -> Answer:
        """The verifier alone on the prompt `serve` would send it: the chat template's
        text, with BOS unless the template writes it (drafter/serve/prompts.py)."""
        prompt = self.vocab.apply_chat_template([(m["role"], m["content"]) for m in messages])
        body = {
            "prompt": prompt,
            "add_bos": not self.vocab.starts_with_bos(prompt),
            "max_tokens": max_tokens,
            "sampling": {"temperature": 0},
        }
        began = time.perf_counter()
        response = self.client.post(f"{self.verifier.url}/generate", json=body)
        seconds = time.perf_counter() - began
        response.raise_for_status()
        reply = response.json()
        tokens = reply["tokens"]
        # The end of the turn counts as a token generated (as `serve` and llama-server count
        # it), but is not in the answer's text.
        shown = tokens[:-1] if reply["eos"] and tokens and self.vocab.is_eog(tokens[-1]) else tokens
        return Answer(text=self.vocab.detokenize(shown), tokens=len(tokens), seconds=seconds)

    def stop(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()
        if self.serve is not None:
            self.serve.stop()
        self.verifier.stop()


class LlamaServer:
    """llama.cpp's `llama-server` in a subprocess on 127.0.0.1, its log in a file."""

    def __init__(self, system: System, args: argparse.Namespace):
        self.system = system
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        mode = [a.format(drafter=args.drafter_model) for a in system.args]
        command = [
            *pin(
                [args.verifier_core]
                if args.llama_one_core
                else [args.verifier_core, args.drafter_core]
            ),
            str(args.llama_server),
            "-m",
            str(args.verifier_model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-t",
            "1",
            "-tb",
            "1",
            "-c",
            str(args.n_ctx),
            "-np",
            "1",
            "--no-webui",
            *mode,
            *shlex.split(args.llama_args),
        ]
        self.log_path = Path(f"/tmp/llama-server-{self.port}.log")
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        self.client = httpx.Client(timeout=1800)
        try:
            wait_healthy(self.url, self.process, f"llama-server ({' '.join(command)})")
        except RuntimeError:
            self.stop()
            raise

    def idle_work_done(self) -> str:
        """Nothing runs here between requests."""
        return ""

    def ask(self, messages: list[dict], max_tokens: int) -> Answer:
        reply, seconds = post_chat(
            self.client, f"{self.url}/v1/chat/completions", messages, max_tokens
        )
        timings = reply.get("timings") or {}
        return Answer(
            text=reply["choices"][0]["message"]["content"] or "",
            tokens=reply["usage"]["completion_tokens"],
            seconds=seconds,
            accepted=timings.get("draft_n_accepted", 0),
            extra={k: timings[k] for k in ("draft_n", "prompt_n", "cache_n") if k in timings},
        )

    def stop(self) -> None:
        self.client.close()
        stop_process(self.process)
        self._log.close()
        self.log_path.unlink(missing_ok=True)


def settle(running: Sequence[Ours | LlamaServer]) -> None:
    """Waits until no system has idle work under way: every verifier here shares one
    core, so one system's idle work would slow the next system's request (at most
    SETTLE_AT_MOST_S, then says so)."""
    began = last_change = time.monotonic()
    last = None
    while time.monotonic() - last_change < SETTLED_S:
        if time.monotonic() - began > SETTLE_AT_MOST_S:
            print("  idle work still under way: the next question goes anyway", file=sys.stderr)
            return
        done = [started.idle_work_done() for started in running]
        if done != last:
            last, last_change = done, time.monotonic()
        time.sleep(0.1)


def by_kind(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]
) -> dict[str, list[int]]:
    """What a request drafted and had accepted, by KINDS: the verifier's counts after it
    less those before (a draft model's drafts: the client's that were not lookups)."""
    delta = {k: [after[k][i] - before[k][i] for i in (0, 1)] for k in DRAFT_METRICS}
    model = [delta["client"][i] - delta["lookup"][i] for i in (0, 1)]
    return {"model": model, "lookup": delta["lookup"], "copies": delta["copies"]}


def run(args: argparse.Namespace, systems: list[System], questions: list[Question]) -> list[dict]:
    """Every question through every system; a row per answer."""
    vocab = None
    if any(s.kind == "generate" for s in systems):
        from server.shared.runtime import LlamaVocab

        vocab = LlamaVocab(args.verifier_model, vocab_only=True)
    running: list[Ours | LlamaServer] = []
    rows: list[dict] = []

    def start_all() -> None:
        for system in systems:
            print(f"starting {system.label}", file=sys.stderr)
            if system.kind == "llama":
                started: Ours | LlamaServer = LlamaServer(system, args)
            else:
                started = Ours(system, args, vocab)
            running.append(started)
            started.ask(WARM_UP, 8)  # loads what loads on first use (serve's draft model)

    try:
        start_all()
        for i, question in enumerate(questions):
            if args.restart_every and i and i % args.restart_every == 0:
                # A process runs some percent faster or slower than the next one: a run
                # over several of each system's processes averages that out.
                while running:
                    running.pop().stop()
                start_all()
            shift = i % len(running)
            for started in running[shift:] + running[:shift]:
                settle(running)  # the turns of one question follow one another at once
                messages: list[dict] = []
                for turn, text in enumerate(question.turns, start=1):
                    messages.append({"role": "user", "content": turn_text(text, messages)})
                    answer = started.ask(messages, args.max_tokens)
                    messages.append({"role": "assistant", "content": answer.text})
                    rows.append(
                        {
                            "system": started.system.name,
                            "question_id": question.id,
                            "category": question.category,
                            "family": question.family,
                            "turn": turn,
                            **asdict(answer),
                        }
                    )
            print(
                f"  {i + 1}/{len(questions)}: {question.family} question {question.id}",
                file=sys.stderr,
            )
    finally:
        for started in running:
            started.stop()
        if vocab is not None:
            vocab.close()
    return rows


def alike(rows: list[dict], systems: list[System]) -> set[tuple[int, int]]:
    """The answers (question, turn) every system wrote with the same text: the same work
    for each, where tokens/s compare speed alone (pure)."""
    texts: dict[tuple[int, int], dict[str, str]] = {}
    for r in rows:
        texts.setdefault((r["question_id"], r["turn"]), {})[r["system"]] = r["text"]
    names = {s.name for s in systems}
    return {
        key
        for key, by_system in texts.items()
        if set(by_system) == names and len(set(by_system.values())) == 1
    }


def summarize(rows: list[dict], families: Sequence[str], systems: list[System]) -> dict:
    """Per family (and "all") and system: tokens, seconds, tokens/s, mean accepted tokens,
    the same over the answers every system wrote alike, and for ours, answers equal to the
    verifier alone's."""
    reference = {
        (r["question_id"], r["turn"]): r["text"] for r in rows if r["system"] == "verifier"
    }
    same = alike(rows, systems)
    summary: dict[str, dict[str, dict]] = {}
    for family in [*families, "all"]:
        summary[family] = {}
        for system in systems:
            mine = [
                r for r in rows if r["system"] == system.name and family in (r["family"], "all")
            ]
            tokens = sum(r["tokens"] for r in mine)
            seconds = sum(r["seconds"] for r in mine)
            accepted = sum(r["accepted"] or 0 for r in mine)
            block = {
                "answers": len(mine),
                "tokens": tokens,
                "seconds": round(seconds, 4),
                "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
                "mean_accepted_tokens": tokens / max(tokens - accepted, 1) if tokens else 0.0,
            }
            kinds = [r["extra"].get("by_kind") for r in mine if r.get("extra")]
            if any(kinds):
                block["by_kind"] = {
                    kind: [sum(k[kind][i] for k in kinds if k) for i in (0, 1)] for kind in KINDS
                }
            both = [r for r in mine if (r["question_id"], r["turn"]) in same]
            both_seconds = sum(r["seconds"] for r in both)
            block["alike_answers"] = len(both)
            block["alike_tokens_per_s"] = (
                sum(r["tokens"] for r in both) / both_seconds if both_seconds > 0 else 0.0
            )
            if system.kind == "serve" and reference:
                compared = [r for r in mine if (r["question_id"], r["turn"]) in reference]
                block["identical"] = sum(
                    r["text"] == reference[(r["question_id"], r["turn"])] for r in compared
                )
                block["compared"] = len(compared)
            summary[family][system.name] = block
    return summary


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "-"


def tables(summary: dict, systems: list[System], n_questions: dict[str, int]) -> str:
    names = [s.name for s in systems]
    llamas = [s.name for s in systems if s.kind == "llama"]
    head = ["family", "questions", *(s.label for s in systems)]
    if "default" in names and "verifier" in names:
        head.append("default / verifier alone")
    if "default" in names and llamas:
        head.append("default / best llama-server")
    lines = [
        "Tokens per second of wall time (generated tokens / seconds of the family's requests):",
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
    ]
    for family, block in summary.items():
        rate = {name: block[name]["tokens_per_s"] for name in names}
        cells = [LABELS.get(family, "all"), str(n_questions[family])]
        cells += [f"{rate[name]:.1f}" for name in names]
        if "default" in names and "verifier" in names:
            cells.append(ratio(rate["default"], rate["verifier"]))
        if "default" in names and llamas:
            cells.append(ratio(rate["default"], max(rate[name] for name in llamas)))
        if family == "all":
            cells = [f"**{c}**" for c in cells]
        lines.append("| " + " | ".join(cells) + " |")
    if llamas:
        lines += ["", *alike_table(summary, systems)]
    drafting = [s for s in systems if s.speculative]
    if drafting:
        lines += [
            "",
            "Mean accepted tokens (Spec-Bench's figure: tokens a verifier pass commits, "
            "generated / (generated - accepted drafts and copies)):",
            "",
            "| family | " + " | ".join(s.label for s in drafting) + " |",
            "|---|" + "---:|" * len(drafting),
        ]
        for family, block in summary.items():
            cells = [f"{block[s.name]['mean_accepted_tokens']:.2f}" for s in drafting]
            lines.append(f"| {LABELS.get(family, 'all')} | " + " | ".join(cells) + " |")
    counted = [s for s in systems if "by_kind" in summary["all"][s.name]]
    if counted:
        lines += ["", *kinds_table(summary, counted)]
    checked = [s for s in systems if "identical" in summary["all"][s.name]]
    if checked:
        same = ", ".join(
            f"{s.label} {summary['all'][s.name]['identical']}/{summary['all'][s.name]['compared']}"
            for s in checked
        )
        lines += ["", f"Greedy answers equal to the verifier alone's: {same}."]
    return "\n".join(lines)


def kinds_table(summary: dict, systems: list[System]) -> list[str]:
    """Draft tokens accepted of those drafted, by kind (the verifier's counts): the draft
    model's, a lookup's (prompt lookup, the suffix drafter) and the verifier's own copies."""
    head = ["family", *(f"{s.label}: {kind}" for s in systems for kind in KINDS)]
    lines = [
        "Draft tokens accepted / drafted, by kind (the verifier's counts: a draft model's, a "
        "lookup's, the verifier's own copies in chunks):",
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
    ]
    for family, block in summary.items():
        cells = [LABELS.get(family, "all")]
        for s in systems:
            counts = block[s.name].get("by_kind") or {k: [0, 0] for k in KINDS}
            cells += [f"{counts[k][1]} / {counts[k][0]}" for k in KINDS]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def alike_table(summary: dict, systems: list[System]) -> list[str]:
    """Tokens/s over the answers every system wrote alike. llama-server's greedy answers
    can differ from ours (its prompt passes' numbers can tip a near-tie), and a longer
    answer spreads its prompt's time over more tokens: on the same text, speed alone."""
    names = [s.name for s in systems]
    llamas = [s.name for s in systems if s.kind == "llama"]
    head = ["family", "answers alike", *(s.label for s in systems)]
    default = "default" in names
    lines = [
        "Tokens per second on the answers every system wrote alike (the same text, the same work):",
        "",
        "| " + " | ".join([*head, *(["default / best llama-server"] if default else [])]) + " |",
        "|---|" + "---:|" * (len(head) - 1 + default),
    ]
    for family, block in summary.items():
        rate = {name: block[name]["alike_tokens_per_s"] for name in names}
        cells = [LABELS.get(family, "all"), str(block[names[0]]["alike_answers"])]
        cells += [f"{rate[name]:.1f}" for name in names]
        if default:
            cells.append(ratio(rate["default"], max(rate[name] for name in llamas)))
        if family == "all":
            cells = [f"**{c}**" for c in cells]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=first_paragraph(__doc__), formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"A smoke run: one question a family, 16 tokens, systems {QUICK_SYSTEMS}, no "
        "llama-server (overrides --per-family, --max-tokens, --systems and --llama-server).",
    )
    parser.add_argument(
        "--families",
        default=",".join(FAMILIES),
        help=f"Task families to run, comma-separated, from: {', '.join(LABELS)} (the last "
        "two: HumanEval's problems as sessions where text repeats).",
    )
    parser.add_argument(
        "--per-family",
        type=int,
        default=0,
        help="Questions per family, the first ones of the file (0: all of them, 40 a family).",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=128, help="Tokens to generate at most per answer."
    )
    parser.add_argument(
        "--systems",
        default=DEFAULT_SYSTEMS,
        help=f"Systems of ours to run, comma-separated, from: {', '.join(s.name for s in OURS)} "
        "(llama-server's modes are added with --llama-server).",
    )
    parser.add_argument(
        "--variant",
        type=variant,
        action="append",
        default=[],
        metavar="NAME[@SYSTEM]:VAR=VALUE[,VAR=VALUE...]",
        help="One more system: `serve`'s default (or SYSTEM, another of ours) on a verifier "
        "with these settings (VERIFIER_* variables), named NAME; may be given more than once.",
    )
    parser.add_argument(
        "--llama-server",
        type=Path,
        help="A llama-server binary (scripts/build_llama_server.sh builds one): adds its "
        "plain, -md and ngram-simple modes.",
    )
    parser.add_argument(
        "--llama-modes",
        default=",".join(s.name for s in LLAMA),
        help="llama-server's modes to run with --llama-server, comma-separated.",
    )
    parser.add_argument(
        "--llama-args",
        default="",
        help="More arguments for every llama-server, as one string (e.g. --no-jinja: render "
        "the chat template as ours does).",
    )
    parser.add_argument(
        "--n-ctx",
        type=int,
        default=2048,
        help="Context length of every verifier session and llama-server slot.",
    )
    parser.add_argument(
        "--verifier-model",
        type=Path,
        default=DEFAULT_VERIFIER_MODEL,
        help="GGUF file of the verifiers (and of llama-server's main model).",
    )
    parser.add_argument(
        "--drafter-model",
        type=Path,
        default=DEFAULT_DRAFTER_MODEL,
        help="GGUF file of `serve`'s draft model (and of llama-server's -md).",
    )
    parser.add_argument(
        "--verifier-core",
        type=int,
        default=1,
        help="CPU core the verifiers are pinned to with taskset (unpinned without taskset).",
    )
    parser.add_argument(
        "--drafter-core",
        type=int,
        default=0,
        help="CPU core `serve` is pinned to with taskset (llama-server gets both cores "
        "unless --llama-one-core).",
    )
    parser.add_argument(
        "--llama-one-core",
        action="store_true",
        help="Pin llama-server to --verifier-core alone, as each verifier of ours is (its "
        "HTTP thread then shares the core its decoding runs on, as a verifier's does); "
        "without it llama-server gets both cores.",
    )
    parser.add_argument(
        "--restart-every",
        type=int,
        default=0,
        metavar="N",
        help="Start every system afresh after every N questions (0: one process a system "
        "for the whole run): the same code runs some percent faster or slower from one "
        "process to the next, and a run over several averages that out. A suffix "
        "drafter's history starts empty again.",
    )
    parser.add_argument("--json", type=Path, help="Write every answer and the summary here.")
    args = parser.parse_args(argv)
    if args.quick:
        args.per_family, args.max_tokens, args.systems = 1, 16, QUICK_SYSTEMS
        args.llama_server = None
    if usable_cores() < 2:
        args.verifier_core = args.drafter_core = None  # one core: nothing to pin apart
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.llama_server:
        if not args.llama_server.is_file():
            parser.error(f"--llama-server {args.llama_server}: no such file")
        names += [s.strip() for s in args.llama_modes.split(",") if s.strip()]
    for family in families:
        if family not in LABELS:
            parser.error(f"unknown family {family!r}: choose from {', '.join(LABELS)}")
    systems_by_name = {**SYSTEMS, **{v.name: v for v in args.variant}}
    names += [v.name for v in args.variant]
    for name in names:
        if name not in systems_by_name or (
            systems_by_name[name].kind == "llama" and not args.llama_server
        ):
            parser.error(f"unknown system {name!r}")
    if args.per_family < 0 or args.max_tokens < 1 or args.restart_every < 0:
        parser.error("--per-family, --restart-every must be 0 or more, --max-tokens 1 or more")
    systems = [systems_by_name[name] for name in dict.fromkeys(names)]
    questions = load_questions(families, args.per_family or None)
    rows = run(args, systems, questions)
    summary = summarize(rows, families, systems)
    n_questions = {f: sum(q.family == f for q in questions) for f in families}
    n_questions["all"] = len(questions)
    print(
        f"verifier {args.verifier_model.name}, drafter {args.drafter_model.name}; one thread a "
        f"model; chat completions, greedy, at most {args.max_tokens} tokens an answer"
    )
    print()
    print(tables(summary, systems, n_questions))
    if args.json:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        results = {"config": config, "summary": summary, "answers": rows}
        args.json.write_text(json.dumps(results, indent=1, default=str))
    bad = [
        (f, s)
        for f, block in summary.items()
        for s, b in block.items()
        if not (math.isfinite(b["tokens_per_s"]) and b["tokens_per_s"] > 0)
    ]
    if bad:
        print(f"\nno tokens measured for: {bad}", file=sys.stderr)


if __name__ == "__main__":
    main()
