"""`draft_token_generator`: drafts locally, verifies remotely, prints the verifier's text.

Thin commands over drafter/runner.py and drafter/serve: every flag is a field of
`DrafterSettings` (its default and help text come from there), errors a user can act on
become one message here.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from drafter.errors import DrafterError
from drafter.output import JsonRenderer, TextRenderer
from drafter.principals import serve_history_scope
from drafter.runner import run
from drafter.settings import DrafterKind, DrafterSettings, HistoryScope, OutputFormat
from drafter.speculative.loop import prefer_quick_handoffs
from server.shared.defaults import REPO_ROOT
from server.shared.protocol import Strategy


def _flag(name: str, *decls: str, default_text: str | None = None) -> Any:
    """A typer option for the settings field `name`: its help text, and its default as
    the settings give it (the flag itself defaults to None: not given)."""
    field = DrafterSettings.model_fields[name]
    default = field.default
    shown = default_text or (
        default.value if hasattr(default, "value") else str(default) if default is not None else ""
    )
    if isinstance(default, Path) and default.is_relative_to(REPO_ROOT):
        shown = str(default.relative_to(REPO_ROOT))  # the models/ folder of this checkout
    help_text = (field.description or "") + (f"  [default: {shown}]" if shown else "")
    return typer.Option(*(decls or (f"--{name.replace('_', '-')}",)), help=help_text)


# One alias per flag, shared by both commands.
ServerOpt = Annotated[str | None, _flag("server")]
ApiKeyOpt = Annotated[str | None, _flag("api_key")]
CaCertOpt = Annotated[Path | None, _flag("ca_cert")]
TimeoutOpt = Annotated[float | None, _flag("timeout")]
RetriesOpt = Annotated[int | None, _flag("retries")]
RestartWaitOpt = Annotated[float | None, _flag("restart_wait")]
ModelOpt = Annotated[Path | None, _flag("model")]
GpuLayersOpt = Annotated[int | None, _flag("n_gpu_layers", default_text="all with Metal/CUDA")]
ThreadsOpt = Annotated[int | None, _flag("threads")]
VerboseOpt = Annotated[bool | None, _flag("verbose", "--verbose")]
TranslateOpt = Annotated[bool | None, _flag("translate", "--translate/--no-translate")]
DraftNOpt = Annotated[str | None, _flag("draft_n")]
DrafterOpt = Annotated[DrafterKind | None, _flag("drafter")]
PipelineOpt = Annotated[
    bool | None, _flag("pipeline", "--pipeline/--no-pipeline", default_text="auto")
]
PMinOpt = Annotated[float | None, _flag("p_min")]
HistoryFileOpt = Annotated[Path | None, _flag("history_file")]
HistoryTokensOpt = Annotated[int | None, _flag("history_tokens")]
BranchesOpt = Annotated[int | None, _flag("branches")]
PromptOpt = Annotated[str | None, _flag("prompt")]
ChatOpt = Annotated[bool | None, _flag("chat", "--chat")]
SystemOpt = Annotated[str | None, _flag("system")]
MaxTokensOpt = Annotated[int | None, _flag("max_tokens")]
OutputOpt = Annotated[OutputFormat | None, _flag("output")]
BaselineOpt = Annotated[bool | None, _flag("baseline", "--baseline")]
TemperatureOpt = Annotated[float | None, _flag("temperature")]
TopKOpt = Annotated[int | None, _flag("top_k")]
TopPOpt = Annotated[float | None, _flag("top_p")]
SeedOpt = Annotated[int | None, _flag("seed")]
StrategyOpt = Annotated[Strategy | None, _flag("strategy", default_text="by temperature")]
ThresholdOpt = Annotated[float | None, _flag("threshold")]
HostOpt = Annotated[str | None, _flag("host")]
PortOpt = Annotated[int | None, _flag("port")]
ParallelOpt = Annotated[int | None, _flag("parallel")]
QueueOpt = Annotated[int | None, _flag("queue")]
MaxBodyBytesOpt = Annotated[int | None, _flag("max_body_bytes")]
ServeApiKeyOpt = Annotated[str | None, _flag("serve_api_key")]
ServeApiKeyFileOpt = Annotated[Path | None, _flag("serve_api_key_file")]
HistoryScopeOpt = Annotated[HistoryScope | None, _flag("history_scope")]
MaxOutputTokensOpt = Annotated[int | None, _flag("max_output_tokens")]
CorsOriginOpt = Annotated[list[str] | None, _flag("cors_origins", "--cors-origin")]

app = typer.Typer(
    add_completion=False,
    # Plain help: every default in full at any width (rich's boxes cut them off).
    rich_markup_mode=None,
    subcommand_metavar="[serve [OPTIONS]]",
    help="Speculative decoding with a local draft model and a remote verifier: "
    "draft_token_generator --prompt TEXT generates a completion; draft_token_generator "
    "serve runs an OpenAI-compatible API. Every option can also be set as a "
    "DRAFTER_<NAME> environment variable (DRAFTER_SERVER, DRAFTER_API_KEY, ...).",
)


def settings_from(params: dict[str, Any]) -> DrafterSettings:
    """The settings: the flags given, over DRAFTER_* variables, over the defaults."""
    given = {name: value for name, value in params.items() if value is not None}
    try:
        return DrafterSettings(**given)
    except ValidationError as exc:
        error = exc.errors()[0]
        message = error["msg"].removeprefix("Value error, ")
        where = ".".join(str(p) for p in error["loc"])
        hint = f"--{where.replace('_', '-')}" if where else "the DRAFTER_* variables"
        raise typer.BadParameter(message, param_hint=hint) from None


def fail(exc: DrafterError) -> typer.Exit:
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    console.print(f"[bold red]error:[/bold red] {escape(str(exc))}")
    return typer.Exit(exc.exit_code)


@app.callback(invoke_without_command=True)
def generate(
    ctx: typer.Context,
    server: ServerOpt = None,
    model: ModelOpt = None,
    prompt: PromptOpt = None,
    draft_n: DraftNOpt = None,
    drafter: DrafterOpt = None,
    history_file: HistoryFileOpt = None,
    history_tokens: HistoryTokensOpt = None,
    pipeline: PipelineOpt = None,
    branches: BranchesOpt = None,
    p_min: PMinOpt = None,
    max_tokens: MaxTokensOpt = None,
    chat: ChatOpt = None,
    system: SystemOpt = None,
    output: OutputOpt = None,
    n_gpu_layers: GpuLayersOpt = None,
    threads: ThreadsOpt = None,
    timeout: TimeoutOpt = None,
    baseline: BaselineOpt = None,
    temperature: TemperatureOpt = None,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    seed: SeedOpt = None,
    strategy: StrategyOpt = None,
    threshold: ThresholdOpt = None,
    api_key: ApiKeyOpt = None,
    ca_cert: CaCertOpt = None,
    retries: RetriesOpt = None,
    restart_wait: RestartWaitOpt = None,
    translate: TranslateOpt = None,
    verbose: VerboseOpt = None,
) -> None:
    """Generate a completion of --prompt, drafting locally and verifying on --server."""
    if ctx.invoked_subcommand is not None:
        return
    settings = settings_from(ctx.params)
    if settings.prompt is None:
        raise typer.BadParameter("a prompt is needed", param_hint="--prompt")
    logging.basicConfig(
        level=logging.INFO if settings.verbose else logging.WARNING, stream=sys.stderr
    )
    if not settings.verbose:  # urllib3 says "Retrying (...)" at each retry: our message suffices
        logging.getLogger("urllib3").setLevel(logging.ERROR)
    renderer = JsonRenderer() if settings.output is OutputFormat.json else TextRenderer()
    try:
        run(settings, renderer)
    except DrafterError as exc:
        raise fail(exc) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None  # the conventional status of SIGINT


@app.command(short_help="Serve an OpenAI-compatible API, decoded speculatively.")
def serve(
    ctx: typer.Context,
    server: ServerOpt = None,
    model: ModelOpt = None,
    host: HostOpt = None,
    port: PortOpt = None,
    draft_n: DraftNOpt = None,
    drafter: DrafterOpt = None,
    history_file: HistoryFileOpt = None,
    history_tokens: HistoryTokensOpt = None,
    history_scope: HistoryScopeOpt = None,
    pipeline: PipelineOpt = None,
    branches: BranchesOpt = None,
    p_min: PMinOpt = None,
    n_gpu_layers: GpuLayersOpt = None,
    threads: ThreadsOpt = None,
    timeout: TimeoutOpt = None,
    restart_wait: RestartWaitOpt = None,
    api_key: ApiKeyOpt = None,
    ca_cert: CaCertOpt = None,
    verbose: VerboseOpt = None,
    translate: TranslateOpt = None,
    parallel: ParallelOpt = None,
    queue: QueueOpt = None,
    max_body_bytes: MaxBodyBytesOpt = None,
    max_output_tokens: MaxOutputTokensOpt = None,
    serve_api_key: ServeApiKeyOpt = None,
    serve_api_key_file: ServeApiKeyFileOpt = None,
    cors_origins: CorsOriginOpt = None,
) -> None:
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions) locally,
    each request decoded speculatively against --server."""
    settings = settings_from(ctx.params)
    try:  # keys and history scope: a contradiction is told before anything starts
        serve_history_scope(settings)
    except ValueError as exc:
        raise fail(DrafterError(str(exc))) from None
    try:
        from drafter.serve.app import serve as run_server
    except ImportError as exc:
        raise fail(
            DrafterError(
                f"`serve` needs the serve extra ({exc.name} is missing): "
                "pip install 'hetero-specdecode[serve]'"
            )
        ) from None
    run_server(settings)


def main() -> None:
    prefer_quick_handoffs()
    app()
