"""`draft_token_generator`: drafts locally, verifies remotely, prints the verifier's text."""

from __future__ import annotations

import logging
import os
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console

from drafter.draft_length import parse_draft_n
from drafter.errors import DrafterError
from drafter.output import JsonRenderer, TextRenderer
from drafter.runner import RunOptions, run
from server import DEFAULT_DRAFTER_MODEL
from server.protocol import SamplingParams

DEFAULT_SERVER = os.environ.get("DRAFTER_SERVER", "http://127.0.0.1:8000")


class StrategyChoice(StrEnum):
    greedy = "greedy"
    rejection = "rejection"
    match = "match"
    threshold = "threshold"


class OutputFormat(StrEnum):
    text = "text"
    json = "json"


ServerOpt = Annotated[
    str, typer.Option("--server", "--dgx", help="verifier base URL", envvar="DRAFTER_SERVER")
]
ModelOpt = Annotated[
    Path,
    typer.Option(
        "--model", help="draft model GGUF (same vocabulary as the verifier)", envvar="DRAFTER_MODEL"
    ),
]
PromptOpt = Annotated[str | None, typer.Option("--prompt", help="the prompt text")]


def _draft_n(value: str) -> int | str:
    try:
        k = parse_draft_n(value)
    except ValueError:
        raise typer.BadParameter("a number of tokens (0-256) or 'auto'") from None
    if k is not None and k > 256:
        raise typer.BadParameter("at most 256")
    return "auto" if k is None else k


DraftNOpt = Annotated[
    str,
    typer.Option(
        "--draft-n",
        help="tokens drafted per round (k), or 'auto': +2 after a fully accepted round, "
        "-1 after a rejection (HF's heuristic schedule); with --drafter ngram, x2 after a "
        "fully accepted round, else one past the accepted prefix",
    ),
]


class DrafterChoice(StrEnum):
    model = "model"
    ngram = "ngram"
    model_ngram = "model+ngram"


DrafterOpt = Annotated[
    DrafterChoice,
    typer.Option(
        "--drafter",
        help="model | ngram (prompt lookup, no model) | model+ngram (lookup, else the model)",
    ),
]
PipelineOpt = Annotated[
    bool | None,
    typer.Option(
        "--pipeline/--no-pipeline",
        help="draft the next round while this one is verified (default: on with a model "
        "drafter, except for seeded sampling)",
        show_default=False,
    ),
]
PMinOpt = Annotated[
    float,
    typer.Option(
        "--p-min",
        min=0.0,
        max=1.0,
        help="stop a draft where the draft model's probability falls below this (0 = off)",
    ),
]
MaxTokensOpt = Annotated[
    int, typer.Option("--max-tokens", min=1, help="tokens to generate at most")
]
ChatOpt = Annotated[bool, typer.Option("--chat", help="apply the model's chat template")]
SystemOpt = Annotated[str | None, typer.Option("--system", help="system message (with --chat)")]
OutputOpt = Annotated[OutputFormat, typer.Option("--output", help="text (streamed) or json")]
GpuLayersOpt = Annotated[
    int | None,
    typer.Option(
        "--n-gpu-layers",
        help="layers on the GPU (default: all where the build has Metal or CUDA, else 0)",
    ),
]
ThreadsOpt = Annotated[
    int,
    typer.Option(
        "--threads",
        min=0,
        envvar="DRAFTER_THREADS",
        help="CPU threads (0 = the cores this process may use)",
    ),
]
TimeoutOpt = Annotated[float, typer.Option("--timeout", min=0.1, help="seconds per request")]
BaselineOpt = Annotated[
    bool, typer.Option("--baseline", help="also run the verifier alone and report the speedup")
]
TemperatureOpt = Annotated[
    float, typer.Option("--temperature", min=0.0, help="0 = greedy (exact, the default)")
]
TopKOpt = Annotated[int, typer.Option("--top-k", min=0, help="keep the k most likely (0 = off)")]
TopPOpt = Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="nucleus mass (1 = off)")]
SeedOpt = Annotated[int | None, typer.Option("--seed", min=0, help="same seed, same output")]
StrategyOpt = Annotated[
    StrategyChoice | None,
    typer.Option(
        "--strategy",
        help="greedy | rejection (default when sampling) | match | threshold (lossy)",
    ),
]
ThresholdOpt = Annotated[
    float | None,
    typer.Option("--threshold", min=0.0, max=1.0, help="with --strategy threshold"),
]
ApiKeyOpt = Annotated[
    str | None, typer.Option("--api-key", envvar="DRAFTER_API_KEY", help="verifier API key")
]
CaCertOpt = Annotated[
    Path | None,
    typer.Option("--ca-cert", help="CA certificate to trust for an https:// verifier"),
]
RetriesOpt = Annotated[
    int, typer.Option("--retries", min=0, help="retries on lost connections and 5xx")
]
VerboseOpt = Annotated[bool, typer.Option("--verbose", help="llama.cpp's log on stderr")]
TranslateOpt = Annotated[
    bool,
    typer.Option(
        "--translate/--no-translate",
        help="draft through text for a verifier with another tokenizer (or refuse the pair)",
    ),
]

app = typer.Typer(
    add_completion=False,
    help="Speculative decoding with a local draft model and a remote verifier.",
)


# Options both commands take, passed to RunOptions as they are named.
SHARED_OPTIONS = (
    "server",
    "model",
    "draft_n",
    "drafter",
    "pipeline",
    "p_min",
    "n_gpu_layers",
    "threads",
    "timeout",
    "api_key",
    "ca_cert",
    "verbose",
)


def _run_options(command_args: dict, **per_command) -> RunOptions:
    """RunOptions from a command's arguments (its `locals()`): the shared ones by name,
    then the command's own."""
    shared = {name: command_args[name] for name in SHARED_OPTIONS}
    shared["draft_n"] = _draft_n(shared["draft_n"])
    shared["drafter"] = shared["drafter"].value
    return RunOptions(**shared, **per_command)


@app.callback(invoke_without_command=True)
def generate(
    ctx: typer.Context,
    server: ServerOpt = DEFAULT_SERVER,
    model: ModelOpt = DEFAULT_DRAFTER_MODEL,
    prompt: PromptOpt = None,
    draft_n: DraftNOpt = "4",
    drafter: DrafterOpt = DrafterChoice.model,
    pipeline: PipelineOpt = None,
    p_min: PMinOpt = 0.0,
    max_tokens: MaxTokensOpt = 80,
    chat: ChatOpt = False,
    system: SystemOpt = None,
    output: OutputOpt = OutputFormat.text,
    n_gpu_layers: GpuLayersOpt = None,
    threads: ThreadsOpt = 0,
    timeout: TimeoutOpt = 60.0,
    baseline: BaselineOpt = False,
    temperature: TemperatureOpt = 0.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    seed: SeedOpt = None,
    strategy: StrategyOpt = None,
    threshold: ThresholdOpt = None,
    api_key: ApiKeyOpt = None,
    ca_cert: CaCertOpt = None,
    retries: RetriesOpt = 6,
    translate: TranslateOpt = True,
    verbose: VerboseOpt = False,
) -> None:
    """Generate a completion of --prompt, drafting locally and verifying on --server."""
    if ctx.invoked_subcommand is not None:
        return
    if prompt is None:
        raise typer.BadParameter("a prompt is needed", param_hint="--prompt")
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr)
    try:
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    except ValidationError as exc:
        raise typer.BadParameter(exc.errors()[0]["msg"]) from None
    options = _run_options(
        locals(),
        prompt=prompt,
        chat=chat,
        system=system,
        max_tokens=max_tokens,
        baseline=baseline,
        retries=retries,
        sampling=sampling,
        strategy=strategy.value if strategy else None,
        threshold=threshold,
        translate=translate,
    )
    renderer = JsonRenderer() if output is OutputFormat.json else TextRenderer()
    try:
        run(options, renderer)
    except DrafterError as exc:
        Console(stderr=True, highlight=False).print(f"[bold red]error:[/bold red] {exc}")
        raise typer.Exit(exc.exit_code) from None


@app.command()
def serve(
    server: ServerOpt = DEFAULT_SERVER,
    model: ModelOpt = DEFAULT_DRAFTER_MODEL,
    host: Annotated[str, typer.Option("--host", help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535)] = 8080,
    draft_n: DraftNOpt = "4",
    drafter: DrafterOpt = DrafterChoice.model,
    pipeline: PipelineOpt = None,
    p_min: PMinOpt = 0.0,
    n_gpu_layers: GpuLayersOpt = None,
    threads: ThreadsOpt = 0,
    timeout: TimeoutOpt = 60.0,
    api_key: ApiKeyOpt = None,
    ca_cert: CaCertOpt = None,
    verbose: VerboseOpt = False,
    parallel: Annotated[
        int,
        typer.Option(
            "--parallel",
            min=1,
            max=16,
            help="generations at once, each its own draft sequence and verifier session",
        ),
    ] = 2,
    queue: Annotated[
        int,
        typer.Option("--queue", min=0, help="requests waiting beyond --parallel; more get 429"),
    ] = 8,
) -> None:
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions) locally,
    each request decoded speculatively against --server."""
    from drafter.openai_server import serve as run_server

    options = _run_options(
        locals(),
        prompt="",
    )
    run_server(options, host, port, parallel=parallel, max_queue=queue)


def main() -> None:
    app()
