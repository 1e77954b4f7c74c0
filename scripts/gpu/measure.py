#!/usr/bin/env python3
"""The verifier measured where it runs (a GPU machine, through scripts/gpu/run.sh): one
report of tables, not a test. For each model:

  probe      the startup probe's verdict with shapes free, pinned, and as it chooses
  shapes     the probe's checks one by one on one runtime: free and pinned shapes, at a
             short context only and after a long one (which shapes move a row's logits)
  physics    one round of 1..16 rows at a short and a long context, and one pass of
             1..64 sessions' 5-row rounds, in ms (the runtime alone, no server)
  load       replayed drafters (the verifier's own tokens, one in four wrong at random,
             costed at --draft-token-ms a draft token as a drafter on its own machine)
             at several counts, fixed k and `auto`, against the same sessions decoded by
             the verifier alone; every output checked against /generate token for token,
             a divergence reported with where it is
  advice     the advised draft length a session is given, idle and under load
  peer       llama.cpp's llama-server on the same model (with --llama-server), plain and
             with --parallel 8

    python3 scripts/gpu/measure.py --model build/gpu/models/llama-1b.gguf --out build/gpu/out
    .venv/bin/python scripts/gpu/measure.py --model M --out DIR --quick   # a rehearsal
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.harness.load import PROMPTS, REPLAY_MISS, references, run_drafters
from scripts.harness.local import LocalVerifier, free_port, stop_process, wait_healthy


class Report:
    """Markdown tables, printed as they come and written to OUT/gpu-report.md (the figures
    also to gpu-report.json)."""

    def __init__(self, out: Path):
        self.out, self.lines, self.data = out, [], {}
        out.mkdir(parents=True, exist_ok=True)

    def say(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)
        (self.out / "gpu-report.md").write_text("\n".join(self.lines) + "\n")

    def table(self, header: list[str], rows: list[list[object]]) -> None:
        self.say("| " + " | ".join(header) + " |")
        self.say("|" + "|".join("---" for _ in header) + "|")
        for row in rows:
            self.say("| " + " | ".join(str(c) for c in row) + " |")
        self.say()

    def keep(self, key: str, value: object) -> None:
        self.data[key] = value
        (self.out / "gpu-report.json").write_text(json.dumps(self.data, indent=1))


def gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"no GPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def verifier_env(model: Path, args, **settings: object) -> dict[str, str]:
    env = {
        "VERIFIER_MODEL_PATH": str(model),
        "VERIFIER_N_GPU_LAYERS": str(args.gpu_layers),
        "VERIFIER_N_CTX": str(args.n_ctx),
        "VERIFIER_MAX_SESSIONS": str(max(args.drafters) + 4),  # the advice's session too
        "VERIFIER_MAX_QUEUE": str(4 * max(args.drafters) + 16),
    }
    env.update({f"VERIFIER_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def probe(report: Report, model: Path, args) -> None:
    rows = []
    for pin in ("off", "on", "auto"):
        began = time.perf_counter()
        with LocalVerifier(verifier_env(model, args, pin_shapes=pin)) as verifier:
            started = time.perf_counter() - began
            info = httpx.get(f"{verifier.url}/info", timeout=60).json()
        rows.append([
            pin, info["batch_invariant"], f"{info['batch_max_diff']:g}", info["pinned_width"],
            info.get("pinned_logits", False),
            info["prefill_chunk_invariant"], info["prompt_chunk"], info["pass_cost_rows"],
            info["flash_attn"], f"{started:.1f}",
        ])  # fmt: skip
    report.say("### (a) The startup probe")
    report.table(
        ["VERIFIER_PIN_SHAPES", "batch_invariant", "batch_max_diff", "pinned_width", "every logit",
         "prefill_chunk_invariant", "prompt_chunk", "pass_cost_rows", "flash_attn",
         "start s"], rows,
    )  # fmt: skip
    report.keep(f"{model.stem}/probe", rows)


def isolated(
    script: str, arguments: list[str], timeout: float, needs: str
) -> tuple[list[dict], str]:
    """scripts/gpu/`script` in a process of its own: the JSON objects it printed (those
    printed before a crash count), and "" or how it ended (a crash, a timeout, or no
    object holding `needs`), with the end of what it wrote."""
    command = [sys.executable, "-X", "faulthandler", str(Path(__file__).with_name(script))]
    try:
        done = subprocess.run(command + arguments, capture_output=True, text=True, timeout=timeout)
        stdout, stderr, ended = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        stdout, stderr, ended = _text(exc.stdout), _text(exc.stderr), "a timeout"
    found = []
    for line in stdout.splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            continue  # llama.cpp's own output, or a line cut off by a kill
    found = [item for item in found if isinstance(item, dict)]
    if not ended and any(needs in item for item in found):
        return found, ""
    tail = "\n".join(stderr.splitlines()[-25:])
    return found, f"{script} ended with {ended or f'no {needs}'}:\n```\n{tail}\n```"


def physics_figures(model: Path, args) -> tuple[dict, dict, str]:
    """scripts/gpu/physics.py: ({context: {rows: ms}}, {sessions: ms}, "" or how it
    ended)."""
    listed = [",".join(str(n) for n in ns) for ns in (args.contexts, args.rows, args.sessions)]
    found, ended = isolated("physics.py", [
        "--model", str(model), "--gpu-layers", str(args.gpu_layers), "--contexts", listed[0],
        "--rows", listed[1], "--sessions", listed[2], "--repeats", str(args.repeats),
    ], timeout=420, needs="passes")  # fmt: skip
    figures = {k: v for line in found for k, v in line.items()}
    rounds = {
        int(c): {int(r): ms for r, ms in by.items()} for c, by in figures.get("rounds", {}).items()
    }
    passes = {int(s): ms for s, ms in figures.get("passes", {}).items()}
    return rounds, passes, ended


def shapes(report: Report, model: Path, args) -> None:
    """Which shapes move a row's logits (scripts/gpu/shapes.py): where the probe says
    inexact, whether pinning, every logit, or the span of a long sequence beside is it."""
    found, ended = isolated("shapes.py", [
        "--model", str(model), "--gpu-layers", str(args.gpu_layers),
        "--sessions", str(args.shape_sessions), "--n-ctx", str(args.n_ctx),
    ], timeout=300, needs="pin")  # fmt: skip
    report.say(f"### (a) Where rows move: the probe's checks, {args.shape_sessions} sessions")
    report.table(
        ["shapes", "checks", "batch_invariant", "max diff", "greedy agrees", "pinned_width",
         "every logit", "s"],
        [["pinned" if r["pin"] == "on" else "free",
          f"after {r['long_context']} cells too" if r["long_context"] else "short context",
          *([r["error"], "", "", "", ""] if "error" in r else
            [r["batch_invariant"], f"{r['max_abs_diff']:g}", r["argmax_agrees"],
             r["pinned_width"], r["pinned_logits"]]), r["s"]] for r in found],
    )  # fmt: skip
    if ended:
        report.say(f"**shapes incomplete**: {ended}")
    report.keep(f"{model.stem}/shapes", found)


def _text(out: str | bytes | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""


def physics(report: Report, model: Path, args) -> None:
    contexts, row_counts, sessions = args.contexts, args.rows, args.sessions
    rounds, passes, ended = physics_figures(model, args)
    if rounds:
        report.say("### (c) One round of n rows, median ms (the runtime alone)")
        report.table(
            ["context", *[f"{r} rows" for r in row_counts], f"{row_counts[-1]} rows / 1 row"],
            [[c, *[f"{rounds[c][r]:.2f}" for r in row_counts],
              f"{rounds[c][row_counts[-1]] / rounds[c][row_counts[0]]:.2f}x"] for c in contexts],
        )  # fmt: skip
    if passes:
        report.say(f"### (c) One pass of n sessions' 5-row rounds at {contexts[0]} tokens, ms")
        report.table(
            ["sessions", "pass ms", "ms a session", "rows"],
            [[s, f"{passes[s]:.2f}", f"{passes[s] / s:.2f}", 5 * s] for s in sessions],
        )
    if ended:
        report.say(f"**physics incomplete**: {ended}")
    report.keep(f"{model.stem}/physics", {"rounds": rounds, "passes": passes})


def prompts_for(n: int) -> list[str]:
    """n prompts; past the first eight, each shares a prompt's text as its prefix."""
    return [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" ({i})") for i in range(n)]


def alone(url: str, prompts: list[str], tokens: int) -> float:
    """Tokens per second of the same sessions decoded by the verifier alone, concurrently."""

    def one(prompt: str) -> int:
        body = {"prompt": prompt, "max_tokens": tokens}
        answer = httpx.post(f"{url}/generate", json=body, timeout=600)
        if answer.status_code != 200:  # the report shows why: no log comes back from there
            raise RuntimeError(f"/generate answered {answer.status_code}: {answer.text[:300]}")
        return len(answer.json()["tokens"])

    began = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        total = sum(pool.map(one, prompts))
    return total / (time.perf_counter() - began)


def first_divergence(outputs, prompts, reference) -> str:
    for i, (out, prompt) in enumerate(zip(outputs, prompts, strict=True)):
        expected = reference[prompt][1]
        for at, (got, want) in enumerate(zip(out, expected, strict=False)):
            if got != want:
                return f"session {i} at token {at}: {got} where alone {want}"
    return ""


def load(report: Report, model: Path, args) -> None:
    rows, advice = [], {}
    with LocalVerifier(verifier_env(model, args)) as verifier:
        # Each drafter commits at most REPLAY_MISS tokens a round (run_drafters' budget);
        # every count's prompts are the first of the most's, so one reference serves all.
        reference, n_vocab = references(
            verifier.url, prompts_for(max(args.drafters)), args.rounds * REPLAY_MISS
        )
        for n in args.drafters:
            prompts = prompts_for(n)
            base = alone(verifier.url, prompts, args.alone_tokens)
            for k in args.ks:
                draft_n = k if k == "auto" else int(k)
                seen: list[int | None] = []
                side = None
                if n == max(args.drafters) and k == args.ks[0]:  # advice under the most load
                    side = functools.partial(_advised_into, seen, verifier.url)
                row = run_drafters(
                    verifier.url, [verifier.url], prompts, rounds=args.rounds, draft_n=draft_n,
                    reference=reference, n_vocab=n_vocab, n_ctx=args.n_ctx,
                    draft_token_s=args.draft_token_ms / 1000.0, misses="random", during=side,
                )  # fmt: skip
                if side is not None:
                    advice["loaded"] = seen
                exact = "yes" if not row.mismatches else "NO: " + first_divergence(
                    row.outputs, prompts, reference)  # fmt: skip
                rows.append([
                    n, k, f"{row.tokens_per_s:.1f}", f"{row.tokens_per_s / n:.1f}",
                    f"{base:.1f}", f"{row.tokens_per_s / base:.2f}x",
                    f"{row.p50_ms:.1f}", f"{row.latency_ms(0.99):.1f}",
                    len(row.errors), exact,
                ])  # fmt: skip
                # printed as it comes: a run cut off at its limit keeps these
                print("[load]", " | ".join(str(c) for c in rows[-1]), flush=True)
                if row.errors:
                    report.say(f"first error ({n} drafters, k {k}): {row.errors[0]}")
        advice["idle"] = advised(verifier.url, 6)
    report.say(
        f"### (b, d) Replayed drafters, {args.draft_token_ms:g} ms a draft token, "
        f"{args.rounds} rounds each"
    )
    report.table(
        ["drafters", "k", "tokens/s", "per session", "alone tokens/s", "against alone",
         "p50 round ms", "p99 round ms", "errors", "output = /generate"], rows,
    )  # fmt: skip
    report.say("### (e) The advised draft length (a session's plain rounds)")
    report.table(
        ["when", "advised_draft"],
        [[when, ", ".join(str(a) for a in values)] for when, values in advice.items()],
    )
    report.keep(f"{model.stem}/load", rows)
    report.keep(f"{model.stem}/advice", advice)


def _advised_into(seen: list, url: str) -> None:
    seen.extend(advised(url, 6))


def advised(url: str, rounds: int) -> list[int | str | None]:
    """A session's advised draft lengths over `rounds` rounds without a draft."""
    with httpx.Client(base_url=url, timeout=600) as client:
        opened = client.post("/prefill", json={"prompt": "The weather today"}).json()
        if "total_tokens" not in opened:  # refused (sessions full, a queue too long)
            return [f"refused: {opened.get('error', opened)}"]
        n_past, seen = opened["total_tokens"], []
        for _ in range(rounds):
            step = client.post(
                "/verify", json={"session_id": opened["session_id"], "n_past": n_past}
            ).json()
            n_past = step["total_tokens"]
            seen.append(step.get("advised_draft"))
        client.delete(f"/sessions/{opened['session_id']}")
    return seen


def peer(report: Report, model: Path, args) -> None:
    rows = []
    for parallel in (1, 8):
        port = free_port()
        process = subprocess.Popen(
            [args.llama_server, "-m", str(model), "-ngl", "99", "--port", str(port),
             "--parallel", str(parallel), "-c", str(args.n_ctx * parallel), "-fa", "on"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, process, "llama-server")
            prompts = prompts_for(parallel)

            one = functools.partial(_completion, url, args.alone_tokens)
            began = time.perf_counter()
            with ThreadPoolExecutor(parallel) as pool:
                total = sum(pool.map(one, prompts))
            rate = total / (time.perf_counter() - began)
            rows.append([parallel, parallel, f"{rate:.1f}", f"{rate / parallel:.1f}"])
        finally:
            stop_process(process)
    report.say("### (f) llama.cpp's llama-server, same model, greedy")
    report.table(["--parallel", "clients", "tokens/s", "per client"], rows)
    report.keep(f"{model.stem}/peer", rows)


def _completion(url: str, tokens: int, prompt: str) -> int:
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0}
    answer = httpx.post(f"{url}/completion", json=body, timeout=600).json()
    return int(answer.get("tokens_predicted", 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, action="append", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="a rehearsal's small sizes")
    parser.add_argument("--only", default="probe,shapes,physics,load,peer")
    parser.add_argument("--gpu-layers", type=int, default=-1)
    parser.add_argument("--draft-token-ms", type=float, default=2.0)
    parser.add_argument("--llama-server", default="")
    args = parser.parse_args()
    quick = args.quick
    args.n_ctx = 256 if quick else 2304
    args.contexts = [16, 128] if quick else [100, 2000]
    args.rows = [1, 2, 4] if quick else [1, 2, 4, 8, 16]
    args.sessions = [1, 2, 4] if quick else [1, 2, 4, 8, 16, 32, 64]
    args.repeats = 3 if quick else 10
    args.shape_sessions = 2 if quick else 8
    args.drafters = [1, 2] if quick else [1, 8, 16, 32, 64]
    args.ks = ["4", "auto"]
    args.rounds = 4 if quick else 24
    args.alone_tokens = 16 if quick else 128
    report = Report(args.out)
    commit = os.environ.get("GIT_COMMIT", "")
    report.say(f"# The verifier on {gpu_name()}")
    report.say(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit or '?'}")
    report.say()
    parts = {"probe": probe, "shapes": shapes, "physics": physics, "load": load, "peer": peer}
    for model in args.model:
        report.say(f"## {model.name} ({model.stat().st_size / 1e9:.2f} GB)")
        report.say()
        for name in args.only.split(","):
            if name == "peer" and not args.llama_server:
                continue
            began = time.perf_counter()
            try:
                parts[name](report, model, args)
            except Exception as exc:  # one part's failure must not lose the others' figures
                report.say(f"**{name} failed**: {type(exc).__name__}: {exc}")
            report.say(f"({name}: {time.perf_counter() - began:.0f} s)")
            report.say()


if __name__ == "__main__":
    sys.exit(main())
