#!/usr/bin/env python3
"""Speculative decoding against the verifier alone, under added network delay: a table
and two plots, not a test.

Starts a verifier pinned to one core (`taskset`), runs the real `draft_token_generator`
CLI pinned to another (two machines, as far as two cores can stand for them), through a
delaying TCP proxy on loopback (scripts/harness/delay_proxy.py), over a fixed prompt set: chat,
code, prose, and an editing task whose answer repeats its input. For each drafter (model
sequential, model pipelined, n-gram) and k it reports acceptance, tokens per round,
tokens/s, the speedup over the verifier alone (`/generate`, through the same proxy) end
to end and after the prompt's prefill, bytes per round, the protocol overhead per round,
and the tokens/s expected from the measured acceptance and times (Leviathan et al.; see
`run_expectation`), with the ratio measured/expected. Greedy throughout; every run's
tokens are checked against the verifier alone.

    .venv/bin/python scripts/bench.py                 # the full grid (tens of minutes on 2 cores)
    .venv/bin/python scripts/bench.py --quick         # one prompt, two delays, a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from drafter.client import VerifierClient  # noqa: E402
from scripts.harness.cli import HelpFormatter, first_paragraph  # noqa: E402
from scripts.harness.delay_proxy import DelayProxy  # noqa: E402
from scripts.harness.local import LocalVerifier  # noqa: E402
from server.shared.defaults import DEFAULT_DRAFTER_MODEL, DEFAULT_VERIFIER_MODEL  # noqa: E402
from server.shared.protocol import GenerateRequest, PrefillRequest  # noqa: E402

PROMPTS = {
    "chat": ("Explain what a hash table is, in a few sentences.", True),
    "code": ("Write a Python function that checks whether a number is prime.", True),
    "prose": ("Write a short story about a lighthouse keeper.", True),
    # Plain completion: the 135M default model copies its input reliably only here.
    "edit": (
        "Text: The committee met on Tuesday to review the annual budget. After a long "
        "discussion, the members agreed to increase funding for the public library and to "
        "reduce spending on new office furniture. The chair thanked everyone for their time "
        "and closed the meeting at noon.\n\nThe same text, with Tuesday changed to Friday:\n"
        "The committee met on Friday",
        False,
    ),
}

SUM_KEYS = (
    "generated_tokens",
    "rounds",
    "drafted",
    "accepted",
    "rejected_rounds",
    "reused_drafts",
    "total_time_s",
    "draft_time_s",
    "round_trip_s",
    "verifier_time_s",
    "prefill_time_s",
    "bytes_sent",
    "bytes_received",
    "speculated_rounds",
    "speculated_rounds_answered",
    "speculated_answers",
    "speculation_hits",
    "rounds_sent_at_once",
)


RANKS = (1, 2, 4)  # hit rates reported for drafting for this many likeliest answers


@dataclass(frozen=True)
class Config:
    drafter: str  # model | ngram
    k: str  # "1".."16" | "auto"
    pipeline: bool
    p_min: float = 0.0
    branches: int = 1  # answers drafted for while a round is out

    @property
    def label(self) -> str:
        if self.drafter == "model":
            mode = "sequential"
            if self.pipeline:
                mode = "pipelined" if self.branches == 1 else f"speculative ({self.branches})"
            label = f"model {mode}"
        else:
            label = self.drafter
        return label + (f" p_min {self.p_min:g}" if self.p_min else "")


@dataclass
class Totals:
    """Sums over the prompt set, so every rate below is pooled (tokens over seconds)."""

    values: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys((*SUM_KEYS, "expected_tokens", "expected_s"), 0.0)
    )
    identical: bool = True
    # Rounds whose answer was the drafter's r-th likeliest (drafter/speculative/speculation.py).
    answer_ranks: dict[int, int] = field(default_factory=dict)

    def add(self, stats: dict) -> None:
        for key in SUM_KEYS:
            self.values[key] += stats.get(key, 0)
        for rank, rounds in stats.get("answer_ranks", {}).items():
            self.answer_ranks[int(rank)] = self.answer_ranks.get(int(rank), 0) + rounds
        tokens, seconds = run_expectation(stats)
        self.values["expected_tokens"] += tokens
        self.values["expected_s"] += seconds

    def __getattr__(self, key: str) -> float:
        try:
            return self.__dict__["values"][key]
        except KeyError:
            raise AttributeError(key) from None


# -- the analytic expectation ------------------------------------------------------------


def acceptance_estimate(accepted: float, rejected_rounds: float) -> float:
    """Per-token acceptance probability alpha, as the geometric model has it: each drafted
    position is reached and then accepted (counted in `accepted`) or refused (one per
    round that refused one). Its maximum-likelihood estimate, which does not use the
    formula it then feeds."""
    tried = accepted + rejected_rounds
    return accepted / tried if tried else 0.0


def expected_tokens_per_round(alpha: float, k: float) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): accepted drafts plus the target's token
    (Leviathan et al. 2023, eq. 1), for i.i.d. acceptance."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def run_expectation(stats: dict) -> tuple[float, float]:
    """(tokens, seconds) one run should take by the model: each round yields the expected
    tokens for its own draft length at the run's measured alpha, and takes its measured
    parts (drafting on the critical path, then the round trip: the verifier's own time
    plus protocol and network), after the prompt's prefill."""
    alpha = acceptance_estimate(stats["accepted"], stats["rejected_rounds"])
    tokens = sum(
        rounds * expected_tokens_per_round(alpha, int(k))
        for k, rounds in stats["rounds_by_draft_len"].items()
    )
    seconds = stats["prefill_time_s"] + stats["draft_time_s"] + stats["round_trip_s"]
    return tokens, seconds


class Baseline(NamedTuple):
    tokens_per_s: float  # the whole request, the prompt's prefill included
    decode_tokens_per_s: float  # after the prompt


def summarize(t: Totals, baseline: Baseline) -> dict[str, float]:
    rounds = t.rounds or 1.0
    # Rounds whose answer the speculation cache looked up (older JSON: every one it drafted for).
    answered = t.speculated_rounds_answered or t.speculated_rounds
    tokens_per_s = t.generated_tokens / t.total_time_s if t.total_time_s else 0.0
    decode_s = t.total_time_s - t.prefill_time_s
    decode_tokens_per_s = t.generated_tokens / decode_s if decode_s > 0 else 0.0
    expected = t.expected_tokens / t.expected_s if t.expected_s else 0.0
    return {
        "acceptance": t.accepted / t.drafted if t.drafted else 0.0,
        "alpha": acceptance_estimate(t.accepted, t.rejected_rounds),
        "k_mean": t.drafted / rounds,
        "tokens_per_round": t.generated_tokens / rounds,
        "tokens_per_s": tokens_per_s,
        "speedup": tokens_per_s / baseline.tokens_per_s if baseline.tokens_per_s else 0.0,
        "decode_speedup": decode_tokens_per_s / baseline.decode_tokens_per_s
        if baseline.decode_tokens_per_s
        else 0.0,
        "bytes_per_round": (t.bytes_sent + t.bytes_received) / rounds,
        "overhead_ms": (t.round_trip_s - t.verifier_time_s) * 1000.0 / rounds,
        "decode_tokens_per_s": decode_tokens_per_s,
        # Drafting on the critical path per drafted token: the draft model's cost per
        # token only in the sequential rows, where every draft is made after the answer.
        "draft_ms_per_token": 1000.0 * t.draft_time_s / t.drafted if t.drafted else 0.0,
        "round_trip_ms": 1000.0 * t.round_trip_s / rounds,
        "expected_tokens_per_s": expected,
        "measured_over_expected": tokens_per_s / expected if expected else 0.0,
        "pipeline_hit_rate": t.reused_drafts / t.drafted if t.drafted else 0.0,
        "hit_rate": t.speculation_hits / answered if answered else 0.0,
        "answers_per_round": t.speculated_answers / t.speculated_rounds
        if t.speculated_rounds
        else 0.0,
        "sent_at_once": t.rounds_sent_at_once / rounds,
        # The hit rate had the drafter drafted for its first r ranked answers every round.
        "hit_rate_within": {
            str(r): sum(n for rank, n in t.answer_ranks.items() if rank < r) / answered
            if answered
            else 0.0
            for r in RANKS
        },
    }


# -- running -----------------------------------------------------------------------------


def pin(core: int | None) -> list[str]:
    if core is None or shutil.which("taskset") is None:
        return []
    return ["taskset", "-c", str(core)]


def cli_command() -> list[str]:
    """The installed `draft_token_generator` beside this interpreter, as a user runs it."""
    script = Path(sys.executable).parent / "draft_token_generator"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "from drafter.cli import main; main()"]


def run_drafter(url: str, config: Config, prompt: str, chat: bool, args) -> dict:
    command = [
        *pin(args.drafter_core),
        *cli_command(),
        "--server",
        url,
        "--model",
        str(args.drafter_model),
        "--prompt",
        prompt,
        "--max-tokens",
        str(args.max_tokens),
        "--threads",
        "1",
        "--draft-n",
        config.k,
        "--drafter",
        config.drafter,
        "--pipeline" if config.pipeline else "--no-pipeline",
        "--branches",
        str(config.branches),
        "--p-min",
        str(config.p_min),
        "--output",
        "json",
        *(["--chat"] if chat else []),
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"drafter failed ({config}): {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def prompt_ids(client: VerifierClient, prompt: str, chat: bool, chat_render) -> list[int]:
    text, add_bos = chat_render(prompt) if chat else (prompt, True)
    opened = client.prefill(PrefillRequest(prompt=text, add_bos=add_bos))
    client.delete_session(opened.session_id)
    return list(opened.prompt_ids)


def measure_alone(
    client: VerifierClient, ids: list[int], max_tokens: int
) -> tuple[list, float, float]:
    """The verifier alone: its tokens, the request's wall time, and the time after the
    prompt (the server's own decode_ms)."""
    began = time.perf_counter()
    response = client.generate(
        GenerateRequest(prompt_tokens=ids, add_bos=False, max_tokens=max_tokens)
    )
    return response.tokens, time.perf_counter() - began, response.timings.decode_ms / 1000.0


def measured_rtt_ms(url: str, n: int = 20) -> float:
    with VerifierClient(url) as client:
        client.info()
        times = []
        for _ in range(n):
            began = time.perf_counter()
            client.info()
            times.append((time.perf_counter() - began) * 1000.0)
    return sorted(times)[n // 2]


def chat_renderer(model_path: Path):
    from drafter.drafters.model import DraftModel

    model = DraftModel(model_path, n_ctx=512, n_threads=1)

    def render(prompt: str) -> tuple[str, bool]:
        text = model.chat_prompt(prompt)
        return text, not model.starts_with_bos(text)

    return render, model


def configs_for(ks: list[str], drafters: list[str], p_mins: list[float]) -> list[Config]:
    """`drafters`: sequential (the model, one round at a time), pipelined (drafting
    ahead for one answer: every token accepted), speculative (for the likeliest four),
    ngram (prompt lookup)."""
    kinds = {
        "sequential": ("model", False, 1),
        "pipelined": ("model", True, 1),
        "speculative": ("model", True, 4),
        "ngram": ("ngram", False, 1),
    }
    return [
        Config(kind, k, pipeline, p_min if kind == "model" else 0.0, branches)
        for d in drafters
        for kind, pipeline, branches in [kinds[d]]
        for p_min in (p_mins if kind == "model" else [0.0])
        for k in ks
    ]


def run_grid(args) -> dict:
    ks = args.ks.split(",")
    delays = [float(d) for d in args.delays.split(",")]
    prompts = {name: PROMPTS[name] for name in args.prompts.split(",")}
    configs = configs_for(ks, args.drafters.split(","), [float(p) for p in args.p_mins.split(",")])
    env = {
        "VERIFIER_MODEL_PATH": str(args.verifier_model),
        "VERIFIER_N_THREADS": "1",
        "VERIFIER_N_CTX": "1024",
        "VERIFIER_MAX_DRAFT": "16",
    }
    results: dict = {"delays": {}, "meta": {}}
    render, chat_model = chat_renderer(args.drafter_model)
    with LocalVerifier(env, command_prefix=pin(args.verifier_core)) as verifier:
        with VerifierClient(verifier.url) as client:
            info = client.info()
            ids = {name: prompt_ids(client, p, chat, render) for name, (p, chat) in prompts.items()}
        chat_model.close()
        results["meta"] = {
            "verifier": f"{info.model} {info.quantization}",
            "cores": os.cpu_count(),
            "verifier_core": args.verifier_core,
            "drafter_core": args.drafter_core,
            "max_tokens": args.max_tokens,
            "prompts": list(prompts),
            "direct_rtt_ms": measured_rtt_ms(verifier.url),
        }
        for delay in delays:
            proxy = DelayProxy(("127.0.0.1", verifier.port), delay).start() if delay else None
            url = proxy.url if proxy else verifier.url
            try:
                results["delays"][str(delay)] = run_delay(url, configs, prompts, ids, args)
                results["delays"][str(delay)]["rtt_ms"] = measured_rtt_ms(url)
            finally:
                if proxy:
                    proxy.close()
    return results


def run_delay(url: str, configs: list[Config], prompts: dict, ids: dict, args) -> dict:
    alone_tokens, alone_time, alone_decode, reference, alone_rate = 0, 0.0, 0.0, {}, {}
    with VerifierClient(url) as client:
        for name in prompts:
            tokens, seconds, decode_s = measure_alone(client, ids[name], args.max_tokens)
            reference[name] = tokens
            alone_rate[name] = Baseline(len(tokens) / seconds, len(tokens) / decode_s)
            alone_tokens += len(tokens)
            alone_time += seconds
            alone_decode += decode_s
    baseline = Baseline(alone_tokens / alone_time, alone_tokens / alone_decode)
    rows = {}
    for config in configs:
        totals, per_prompt = Totals(), {}
        for name, (prompt, chat) in prompts.items():
            out = run_drafter(url, config, prompt, chat, args)
            totals.add(out["stats"])
            totals.identical &= out["tokens"] == reference[name]
            one = Totals()
            one.add(out["stats"])
            per_prompt[name] = summarize(one, alone_rate[name])
        key = f"{config.label} k={config.k}"
        rows[key] = {
            "drafter": config.label,
            "k": config.k,
            "branches": config.branches if config.pipeline else 0,
            "identical": totals.identical,
            **summarize(totals, baseline),
            "per_prompt": per_prompt,
        }
        print(f"  {url} {key}: {rows[key]['speedup']:.2f}x", flush=True)
    return {
        "baseline_tokens_per_s": baseline.tokens_per_s,
        "baseline_decode_tokens_per_s": baseline.decode_tokens_per_s,
        "baseline_by_prompt": {name: rate.tokens_per_s for name, rate in alone_rate.items()},
        "rows": rows,
    }


# -- reporting ---------------------------------------------------------------------------


def within(row: dict) -> str:
    """Hit rates within the first 1/2/4 ranked answers; a dash past the answers the row's
    drafter ranks (pipelined: one), none for a drafter that does not draft ahead."""
    rates = row.get("hit_rate_within", {})
    ranked = row.get("branches", max(RANKS))
    return "/".join(f"{rates.get(str(r), 0):.2f}" if r <= ranked else "-" for r in RANKS)


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [
        f"Verifier {meta['verifier']} on core {meta['verifier_core']}, drafter (Q4_K_M, "
        f"1 thread) on core {meta['drafter_core']} of {meta['cores']}; greedy, "
        f"{meta['max_tokens']} tokens for each of {', '.join(meta['prompts'])}; loopback "
        f"round trip without the proxy {meta['direct_rtt_ms']:.2f} ms.",
        "",
        "| added RTT ms (measured) | drafter | k | acceptance | tokens/round | tokens/s "
        "| verifier alone tok/s | speedup | decode speedup | bytes/round | overhead ms/round "
        "| answers drafted for/round | hit rate | answer among likeliest 1/2/4 | sent at once "
        "| expected tok/s | measured/expected | identical |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for delay, block in results["delays"].items():
        for row in block["rows"].values():
            lines.append(
                f"| {float(delay):g} ({block['rtt_ms']:.1f}) | {row['drafter']} | {row['k']} "
                f"| {row['acceptance']:.2f} | {row['tokens_per_round']:.2f} "
                f"| {row['tokens_per_s']:.1f} | {block['baseline_tokens_per_s']:.1f} "
                f"| {row['speedup']:.2f}x | {row.get('decode_speedup', 0):.2f}x "
                f"| {row['bytes_per_round']:.0f} "
                f"| {row['overhead_ms']:.2f} | {row.get('answers_per_round', 0):.1f} "
                f"| {row.get('hit_rate', 0):.2f} | {within(row)} "
                f"| {row.get('sent_at_once', 0):.2f} "
                f"| {row['expected_tokens_per_s']:.1f} "
                f"| {row['measured_over_expected']:.2f} | {'yes' if row['identical'] else 'NO'} |"
            )
    names = meta["prompts"]
    lines += [
        "",
        "Per task: speedup over the verifier alone on that task, end to end / after the "
        "prompt (acceptance, measured/expected).",
        "",
        "| added RTT ms | drafter | k | " + " | ".join(names) + " |",
        "|---|---|---|" + "---:|" * len(names),
    ]
    for delay, block in results["delays"].items():
        for row in block["rows"].values():
            cells = [
                f"{p['speedup']:.2f}x / {p.get('decode_speedup', 0):.2f}x "
                f"({p['acceptance']:.2f}, {p['measured_over_expected']:.2f})"
                for p in (row["per_prompt"][name] for name in names)
            ]
            lines.append(
                f"| {float(delay):g} | {row['drafter']} | {row['k']} | " + " | ".join(cells) + " |"
            )
    lines += projection_lines(results)
    return "\n".join(lines) + "\n"


def batched_drafter_tokens_per_s(row: dict, sequential: dict, hit_rate: float) -> float:
    """Tokens/s after the prompt, on paper, of a drafter whose batched decode drafts for
    several answers in the time of one (a GPU drafter, where a decode of a few sequences
    costs about what one does; assumed, not measured here). A round whose answer was
    drafted for goes out once both the answer and that draft are there; any other waits
    for its draft after the answer. Tokens per round and draft length are the
    speculative row's; the draft cost per token and the round trip are the sequential
    row's, where nothing else drafts on the drafter's core meanwhile."""
    draft_ms = row["k_mean"] * sequential["draft_ms_per_token"]
    round_ms = max(sequential["round_trip_ms"], draft_ms) + (1.0 - hit_rate) * draft_ms
    return 1000.0 * row["tokens_per_round"] / round_ms if round_ms > 0 else 0.0


def projection_lines(results: dict) -> list[str]:
    """The paper table: for each speculative row, what drafting for its first 1, 2 or 4
    ranked answers at once would give, beside what this machine measured."""
    lines = [
        "",
        "On paper (computed from the rows above, not measured): a drafter whose batched "
        "decode drafts for its first B ranked answers in the time of one, with this run's "
        "acceptance, draft lengths and hit rates within B, and the sequential row's draft "
        "cost per token and round trip. Tokens/s after the prompt.",
        "",
        "| added RTT ms | drafter | k | B = 1 | B = 2 | B = 4 | measured: pipelined "
        "| measured: speculative | verifier alone |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for delay, block in results["delays"].items():
        rows = block["rows"]
        for row in rows.values():
            branches = row.get("branches", 1)
            mode = f"speculative ({branches})"
            if mode not in row["drafter"]:
                continue
            # The same drafter and p_min, one answer at a time and pipelined.
            sequential = rows.get(f"{row['drafter'].replace(mode, 'sequential')} k={row['k']}")
            pipelined = rows.get(f"{row['drafter'].replace(mode, 'pipelined')} k={row['k']}")
            if sequential is None or "round_trip_ms" not in row:
                continue
            cells = [
                batched_drafter_tokens_per_s(row, sequential, row["hit_rate_within"][str(b)])
                for b in RANKS
            ]
            measured = f"{pipelined['decode_tokens_per_s']:.1f}" if pipelined else "n/a"
            lines.append(
                f"| {float(delay):g} | {row['drafter']} | {row['k']} | "
                + " | ".join(f"{c:.1f}" for c in cells)
                + f" | {measured} | {row['decode_tokens_per_s']:.1f} "
                f"| {block['baseline_decode_tokens_per_s']:.1f} |"
            )
    return lines


def plot(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    delays = list(results["delays"])
    first_rows = results["delays"][delays[0]]["rows"].values()
    drafters = list(dict.fromkeys(row["drafter"] for row in first_rows))
    ks = list(dict.fromkeys(row["k"] for row in first_rows))
    paths = []

    fig, axes = plt.subplots(1, len(drafters), figsize=(5 * len(drafters), 4), sharey=True)
    for ax, drafter in zip(axes if len(drafters) > 1 else [axes], drafters, strict=True):
        for delay in delays:
            rows = [r for r in results["delays"][delay]["rows"].values() if r["drafter"] == drafter]
            ax.plot([r["k"] for r in rows], [r["speedup"] for r in rows], marker="o",
                    label=f"+{float(delay):g} ms")  # fmt: skip
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_title(drafter)
        ax.set_xlabel("k (draft tokens per round)")
    (axes[0] if len(drafters) > 1 else axes).set_ylabel("speedup over the verifier alone")
    (axes[-1] if len(drafters) > 1 else axes).legend(title="added round trip")
    fig.tight_layout()
    paths.append(out_dir / "speedup_vs_k.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(drafters), figsize=(5 * len(drafters), 4), sharey=True)
    x = [float(d) for d in delays]
    for ax, drafter in zip(axes if len(drafters) > 1 else [axes], drafters, strict=True):
        for k in ks:
            y = [
                results["delays"][d]["rows"].get(f"{drafter} k={k}", {}).get("speedup", 0)
                for d in delays
            ]
            ax.plot(x, y, marker="o", label=f"k={k}")
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_title(drafter)
        ax.set_xlabel("added round trip (ms)")
    (axes[0] if len(drafters) > 1 else axes).set_ylabel("speedup over the verifier alone")
    (axes[-1] if len(drafters) > 1 else axes).legend()
    fig.tight_layout()
    paths.append(out_dir / "speedup_vs_delay.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=first_paragraph(__doc__), formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="A smoke run: the edit prompt, delays 0 and 20 ms, k 4 and auto, 24 tokens "
        "(overrides --delays, --ks, --prompts and --max-tokens).",
    )
    parser.add_argument(
        "--delays",
        default="0,5,20,50,100",
        help="Round trips added by the delaying proxy, in ms, comma-separated (0: no proxy).",
    )
    parser.add_argument(
        "--ks",
        default="1,2,4,8,auto",
        help="Draft lengths to try, comma-separated; 'auto' for the adaptive length.",
    )
    parser.add_argument(
        "--prompts",
        default=",".join(PROMPTS),
        help=f"Prompts to run, comma-separated, from: {', '.join(PROMPTS)}.",
    )
    parser.add_argument(
        "--drafters",
        default="sequential,pipelined,speculative,ngram",
        help="Drafters to compare, comma-separated: sequential (the draft model, one round "
        "at a time), pipelined (drafting ahead for the all-accepted answer), speculative "
        "(drafting ahead for the likeliest four answers), ngram (prompt lookup).",
    )
    parser.add_argument(
        "--p-mins",
        default="0",
        help="Draft-model confidence cut-offs to try, comma-separated: a draft stops where "
        "its token's probability falls below one (0: off; n-gram rows ignore it).",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="Tokens to generate for each prompt."
    )
    parser.add_argument(
        "--verifier-model",
        type=Path,
        default=DEFAULT_VERIFIER_MODEL,
        help="GGUF file the local verifier serves.",
    )
    parser.add_argument(
        "--drafter-model",
        type=Path,
        default=DEFAULT_DRAFTER_MODEL,
        help="GGUF file of the draft model (also renders the chat prompts).",
    )
    parser.add_argument(
        "--verifier-core",
        type=int,
        default=1,
        help="CPU core the verifier is pinned to with taskset (unpinned on one core, or "
        "without taskset).",
    )
    parser.add_argument(
        "--drafter-core",
        type=int,
        default=0,
        help="CPU core the drafter CLI is pinned to with taskset (unpinned on one core, or "
        "without taskset).",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=REPO_ROOT / "bench-results" / "bench",
        help="Where the table (bench.md), the JSON (bench.json) and the plots go "
        "(docs/performance.md says how the published figures were made).",
    )
    parser.add_argument(
        "--no-plots", action="store_true", help="Write the table and JSON but not the plots."
    )
    parser.add_argument(
        "--replot",
        action="store_true",
        help="Run nothing: redraw the table and plots from the JSON in --out-dir.",
    )
    args = parser.parse_args(argv)
    if args.replot:
        results = json.loads((args.out_dir / "bench.json").read_text())
        (args.out_dir / "bench.md").write_text(markdown(results))
        for path in plot(results, args.out_dir):
            print(f"wrote {path}")
        return
    if args.quick:
        args.delays, args.ks, args.prompts, args.max_tokens = "0,20", "4,auto", "edit", 24
    if (os.cpu_count() or 1) < 2:
        args.verifier_core = args.drafter_core = None
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = run_grid(args)
    # The measurements first: a table or plot that fails can be redrawn (--replot).
    (args.out_dir / "bench.json").write_text(json.dumps(results, indent=1))
    table = markdown(results)
    print(table)
    (args.out_dir / "bench.md").write_text(table)
    if not args.no_plots:
        for path in plot(results, args.out_dir):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
