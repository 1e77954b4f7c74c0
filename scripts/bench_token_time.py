#!/usr/bin/env python3
"""Where a generated token's time goes, path by path, beside llama.cpp's own server: a
table, not a test.

One chat prompt, greedy, the same tokens on every path, the model on one core with one
thread (`taskset`, where there are two cores). Each row is a path a token can take, from
the floor up, in milliseconds a generated token (the median over the repeats, each of
which starts every process afresh), and what it adds to the row before it:

- decode, in process: llama-cpp-python's llama_decode of one row a token and the argmax
  (server/shared/runtime.py): llama.cpp's own speed as the verifier calls it.
- engine, in process: the verifier's engine stepping a chunk (server/verifier/scheduling/cycle.py,
  one row a pass, its tokens answered together): what the engine's bookkeeping adds.
- /verify chunks: the verifier under uvicorn, chunks of CHUNK tokens asked over HTTP
  (the prompt's prefill not counted): what the server, its scheduler and the link add.
- serve: a chat completion through `draft_token_generator serve`, its default settings,
  unwatched (the drafter on the other core): what the drafter's side adds, the prompt's
  turn included (cached by a short request before).
- llama-server: llama.cpp's server on the same core, `/completion` (its prompt cache
  on): its own time a token, and its wall time a token.

A request to the verifier goes once its idle work (a cached prefix evaluated again in
tiles) has stopped: it would share the core. The last column says whether a path's tokens
were the in-process decode's (where the path returns its tokens).

    .venv/bin/python scripts/bench_token_time.py --llama-server build/llama-server/bin/llama-server
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from scripts.harness.cli import HelpFormatter, first_paragraph
from scripts.harness.local import (
    LocalServe,
    LocalVerifier,
    free_port,
    stop_process,
    wait_healthy,
)
from server.shared.defaults import DEFAULT_DRAFTER_MODEL, DEFAULT_VERIFIER_MODEL

QUESTION = "Write a long story about a lighthouse keeper and a storm."
CHUNK = 64  # tokens a /verify chunk asks for (the most a round may ask for)
RETILED_METRIC = "verifier_prompt_tokens_retiled_total"


def chat_prompt(model: Path) -> tuple[str, bool]:
    """The prompt `serve` sends the verifier for QUESTION, and whether BOS goes before it."""
    from server.shared.runtime import LlamaVocab

    vocab = LlamaVocab(model, vocab_only=True)
    try:
        prompt = vocab.apply_chat_template([("user", QUESTION)])
        return prompt, not vocab.starts_with_bos(prompt)
    finally:
        vocab.close()


def in_process(model: Path, tokens: int, repeats: int) -> dict[str, dict]:
    """The decode and engine rows, in this process (pinned by the caller): ms a token
    (`ms`, a repeat each) and the tokens generated (`tokens`)."""
    from server.shared.protocol import PrefillRequest, VerifyRequest
    from server.shared.runtime import BatchEntry
    from server.verifier.decoding.checks import round_key
    from server.verifier.edge.app import build_engine
    from server.verifier.scheduling.cycle import CycleStep, Job
    from server.verifier.settings import VerifierSettings

    engine = build_engine(VerifierSettings(model_path=model, n_threads=1))
    cycle, runtime = CycleStep(engine), engine.runtime
    prompt, add_bos = chat_prompt(model)
    prompt_ids = runtime.tokenize(prompt, add_special=add_bos)
    seq_id = engine.n_seq - 1  # one session at a time below: it never takes the last
    out: dict[str, dict] = {"decode": {"ms": []}, "engine": {"ms": []}}
    for _ in range(repeats):
        runtime.clear(seq_id)
        last = len(prompt_ids) - 1
        rows = runtime.decode(
            [BatchEntry(t, i, seq_id, i == last) for i, t in enumerate(prompt_ids)]
        )
        token, position = int(rows[-1].argmax()), len(prompt_ids)
        generated = [token]
        began = time.perf_counter()
        for _ in range(tokens - 1):
            rows = runtime.decode([BatchEntry(token, position, seq_id, True)])
            token, position = int(rows[0].argmax()), position + 1
            generated.append(token)
        out["decode"]["ms"].append((time.perf_counter() - began) * 1000.0 / (tokens - 1))
        out["decode"]["tokens"] = generated
        runtime.clear(seq_id)

        job = Job("bench", None, PrefillRequest(prompt=prompt, add_bos=add_bos))
        while not (answers := dict(cycle.step([job]).answers)):
            pass
        opened, got = answers[job], []
        n_past, session_id = opened.response.total_tokens, opened.response.session_id
        began = time.perf_counter()
        while len(got) < tokens:
            request = VerifyRequest(
                session_id=session_id, n_past=n_past, chunk_tokens=min(CHUNK, tokens - len(got))
            )
            job = Job("bench", session_id, request=request, round_key=round_key(request))
            while not (answers := dict(cycle.step([job]).answers)):
                pass
            answer = answers[job]
            got, n_past = got + answer.tokens, answer.total_tokens
            if answer.eos:
                break
        out["engine"]["ms"].append((time.perf_counter() - began) * 1000.0 / len(got))
        out["engine"]["tokens"] = got
        engine.sessions.delete(session_id, "bench")
    engine.close()
    return out


def verify_chunks(url: str, prompt: str, add_bos: bool, tokens: int) -> tuple[float, list[int]]:
    """ms a token of /verify chunks after the prompt's prefill, and the tokens."""
    with httpx.Client(base_url=url, timeout=600) as client:
        opened = client.post("/prefill", json={"prompt": prompt, "add_bos": add_bos}).json()
        session_id, n_past, got = opened["session_id"], opened["total_tokens"], []
        began = time.perf_counter()
        while len(got) < tokens:
            body = {
                "session_id": session_id,
                "n_past": n_past,
                "chunk_tokens": min(CHUNK, tokens - len(got)),
            }
            answer = client.post("/verify", json=body).json()
            got, n_past = got + answer["tokens"], answer["total_tokens"]
            if answer["eos"]:
                break
        seconds = time.perf_counter() - began
        client.delete(f"/sessions/{session_id}")
    return seconds * 1000.0 / len(got), got


def settled(verifier_url: str, quiet_s: float = 1.5, at_most_s: float = 60.0) -> None:
    """Waits until the verifier's idle work (a cached prefix evaluated again in tiles, after
    a quiet moment) has stood still `quiet_s`: it shares the model's core with the next
    request."""
    began = last_change = time.monotonic()
    last = None
    while time.monotonic() - last_change < quiet_s and time.monotonic() - began < at_most_s:
        text = httpx.get(f"{verifier_url}/metrics", timeout=30).text
        done = [ln for ln in text.splitlines() if ln.startswith(RETILED_METRIC)]
        if done != last:
            last, last_change = done, time.monotonic()
        time.sleep(0.1)


def serve_chat(url: str, tokens: int) -> float:
    """ms a token of a chat completion through serve, wall time."""
    body = {
        "model": "any",
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": tokens,
        "temperature": 0,
    }
    with httpx.Client(timeout=600) as client:
        began = time.perf_counter()
        reply = client.post(f"{url}/chat/completions", json=body)
        seconds = time.perf_counter() - began
    reply.raise_for_status()
    return seconds * 1000.0 / reply.json()["usage"]["completion_tokens"]


class LlamaServer:
    def __init__(self, binary: Path, model: Path, prefix: list[str]):
        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rsplit(":", 1)[1]
        command = [*prefix, str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", port]
        command += ["-t", "1", "-tb", "1", "-np", "1", "--no-webui", "--no-jinja"]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            wait_healthy(self.url, self.process, f"llama-server ({' '.join(command)})")
        except RuntimeError:
            self.stop()
            raise

    def completion(self, prompt: str, tokens: int) -> tuple[float, float, list[int]]:
        """(its own ms a token, wall ms a token after its prompt, the tokens)."""
        body = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "top_k": 1}
        body["return_tokens"] = True
        began = time.perf_counter()
        reply = httpx.post(f"{self.url}/completion", json=body, timeout=600).json()
        wall_ms = (time.perf_counter() - began) * 1000.0
        timings = reply["timings"]
        n = timings["predicted_n"]
        own, wall = timings["predicted_per_token_ms"], (wall_ms - timings["prompt_ms"]) / n
        return own, wall, reply.get("tokens") or []

    def stop(self) -> None:
        stop_process(self.process)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=first_paragraph(__doc__), formatter_class=HelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=256, help="Tokens generated a request.")
    parser.add_argument(
        "--repeats", type=int, default=3, help="Requests a row (the median counts)."
    )
    parser.add_argument(
        "--llama-server",
        type=Path,
        help="A llama-server binary (scripts/build_llama_server.sh builds one): adds its rows.",
    )
    parser.add_argument(
        "--model", type=Path, default=DEFAULT_VERIFIER_MODEL, help="The model (GGUF)."
    )
    parser.add_argument(
        "--drafter-model", type=Path, default=DEFAULT_DRAFTER_MODEL, help="serve's draft model."
    )
    parser.add_argument("--quick", action="store_true", help="16 tokens, one repeat: a smoke run.")
    parser.add_argument("--json", type=Path, help="Also write the rows here, as JSON.")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.repeats = 16, 1
    if args.tokens < 2 or args.repeats < 1:
        parser.error(
            "--tokens must be at least 2 (a token is timed after the first) and --repeats 1"
        )
    if args.child:
        print(json.dumps(in_process(args.model, args.tokens, args.repeats)))
        return
    cores = sorted(os.sched_getaffinity(0))[:2] if hasattr(os, "sched_getaffinity") else []
    pinned = len(cores) == 2 and shutil.which("taskset") is not None
    model_core = ["taskset", "-c", str(cores[1])] if pinned else []
    other_core = ["taskset", "-c", str(cores[0])] if pinned else []
    prompt, add_bos = chat_prompt(args.model)
    rows: dict[str, list[float]] = {}
    texts: dict[str, list[int]] = {}  # each path's tokens (its last repeat's)

    child = [sys.executable, __file__, "--child", "--model", str(args.model)]
    child += ["--tokens", str(args.tokens), "--repeats", "1"]
    env = {"VERIFIER_MODEL_PATH": str(args.model), "VERIFIER_N_THREADS": "1"}
    # Every repeat starts every process afresh, and goes through every path in turn: the
    # same path runs some percent faster or slower from one process to the next, and the
    # machine's speed drifts, so both fall on all paths alike.
    for repeat in range(args.repeats):
        print(f"repeat {repeat + 1}/{args.repeats}", file=sys.stderr)
        done = subprocess.run([*model_core, *child], capture_output=True, text=True, check=True)
        for name, row in json.loads(done.stdout.strip().splitlines()[-1]).items():
            rows.setdefault(f"{name}, in process", []).extend(row["ms"])
            texts[f"{name}, in process"] = row["tokens"]
        with LocalVerifier(env, command_prefix=model_core) as verifier:
            settled(verifier.url)
            ms, texts["/verify chunks"] = verify_chunks(verifier.url, prompt, add_bos, args.tokens)
            rows.setdefault("/verify chunks", []).append(ms)
            serve = LocalServe(
                verifier.url, "--model", str(args.drafter_model), command_prefix=other_core
            )
            try:
                serve_chat(serve.url, 8)  # loads the draft model
                settled(verifier.url)
                rows.setdefault("serve", []).append(serve_chat(serve.url, args.tokens))
            finally:
                serve.stop()
        if args.llama_server:
            server = LlamaServer(args.llama_server, args.model, model_core)
            try:
                server.completion(prompt, 8)  # its prompt cached, as the others' is
                own, wall, texts["llama-server, wall"] = server.completion(prompt, args.tokens)
            finally:
                server.stop()
            rows.setdefault("llama-server, its own time", []).append(own)
            rows.setdefault("llama-server, wall", []).append(wall)

    floor = statistics.median(rows["decode, in process"])
    reference = texts["decode, in process"]
    report = {
        name: {
            "ms": values,
            "median_ms": statistics.median(values),
            # Only paths that return their tokens; a shorter answer (an end) as its prefix.
            "same_tokens": (
                texts[name] == reference[: len(texts[name])] if texts.get(name) else None
            ),
        }
        for name, values in rows.items()
    }
    where = f"the model on core {cores[1]}" if pinned else "not pinned"
    print(f"{args.model.name}, {args.tokens} tokens a request, {args.repeats} repeats, {where}")
    print("| path | ms a token (median) | min | max | vs decode, in process | same tokens |")
    print("|---|---:|---:|---:|---:|---|")
    for name, row in report.items():
        same = {True: "yes", False: "NO", None: "—"}[row["same_tokens"]]
        print(
            f"| {name} | {row['median_ms']:.3f} | {min(row['ms']):.3f} | {max(row['ms']):.3f} | "
            f"{row['median_ms'] / floor:.3f} | {same} |"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
