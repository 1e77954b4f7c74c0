"""The verifier's model loaded as its settings say: where it computes (a GPU asked of a
build without one stops the start, naming the fix), how much context each session gets
(the model's trained context where memory allows), how many threads a lone row takes."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from server.shared.devices import Placement, list_devices, placement
from server.shared.machine import ContextChoice, available_memory, session_context
from server.shared.runtime import LlamaRuntime, LlamaVocab, supports_gpu_offload
from server.verifier.settings import VerifierSettings

log = logging.getLogger(__name__)

# The share of the free memory where the KV cache lives that it takes by default: the
# rest is for compute buffers, the weights' pages, other processes.
KV_SHARE = 0.5
GPU_BUILD_HINT = (
    'CMAKE_ARGS="-DGGML_CUDA=on" ./scripts/setup.sh (Metal: CMAKE_ARGS="-DGGML_METAL=on"), '
    "or VERIFIER_N_GPU_LAYERS=0 for the CPU (docs/deployment.md)"
)


@dataclass(frozen=True, slots=True)
class Loaded:
    """A loaded runtime and what decided its shape: /info and the ready line say both."""

    runtime: LlamaRuntime
    context: ContextChoice
    placement: Placement


def load(settings: VerifierSettings) -> Loaded:
    if settings.n_gpu_layers != 0 and not supports_gpu_offload():
        raise RuntimeError(
            f"VERIFIER_N_GPU_LAYERS={settings.n_gpu_layers} asks for a GPU, but this "
            f"llama-cpp-python was built without GPU support: rebuild it with {GPU_BUILD_HINT}"
        )
    # Each sequence has room past its context for the widest pass (a padded round, filler
    # rows, a prompt's stretch padded to a tile), and one llama_decode holds a pass of
    # every sequence at a round's width.
    widest = max(settings.max_draft + 1, settings.pin_width)
    room = max(widest, settings.prompt_tile_rows if settings.prompt_pad != "off" else 0)
    chosen: list[tuple[ContextChoice, Placement]] = []

    def cells(model: LlamaVocab) -> int:
        choice, where = context_for(settings, model, room)
        chosen.append((choice, where))
        return choice.n_ctx + room

    runtime = LlamaRuntime(
        settings.model_path,
        n_ctx_per_seq=cells,
        n_seq_max=settings.max_sessions,
        n_batch=max(settings.n_batch, settings.max_sessions * widest),
        n_threads=settings.n_threads,
        single_row_threads=single_row_threads(settings),
        n_gpu_layers=settings.n_gpu_layers,
        flash_attn=settings.flash_attn,
        verbose=settings.verbose,
    )
    return Loaded(runtime, *chosen[0])


def context_for(
    settings: VerifierSettings, model: LlamaVocab, room: int
) -> tuple[ContextChoice, Placement]:
    """A session's context: VERIFIER_N_CTX where set, else the model's trained context as
    far as VERIFIER_KV_CACHE_MB (default: a share of the memory free where the cache
    lives, after the weights) holds it for VERIFIER_MAX_SESSIONS sessions."""
    devices = list_devices()
    where = placement(devices, settings.n_gpu_layers, model.n_layer)
    budget = settings.kv_cache_mb * 2**20
    if not budget:
        gpu = next((d for d in devices if d.is_gpu), None)
        if where.gpu_layers and gpu is not None:
            free = gpu.free_bytes
        else:
            # The weights are mapped from the file: what the system counts as free memory
            # holds their pages, which every pass reads.
            free = max(0, available_memory() - settings.model_path.stat().st_size)
        budget = int(free * KV_SHARE)
    choice = session_context(
        asked=settings.n_ctx,
        n_ctx_train=model.n_ctx_train,
        kv_bytes_per_token=model.kv_bytes_per_token,
        n_sessions=settings.max_sessions,
        budget_bytes=budget,
        room=room,
    )
    cache = settings.max_sessions * (choice.n_ctx + room) * model.kv_bytes_per_token
    log.info(
        "KV cache: %d sessions of %d tokens, %.0f MiB",
        settings.max_sessions,
        choice.n_ctx,
        cache / 2**20,
    )
    return choice, where


def single_row_threads(settings: VerifierSettings) -> int:
    """Threads for a pass of one row (0: as many as for any pass). The CPU build's flash
    attention splits a lone row's keys between threads once its sequence holds more than
    256 cells, and sums the parts in another order than a pass of more rows does: the
    verifier alone would then not decode what a round does (docs/numerics.md). With one
    thread the split is one part, the same sums. Where a GPU runs every layer, the CPU
    computes no attention."""
    every_layer_on_gpu = settings.n_gpu_layers < 0 and supports_gpu_offload()
    return 0 if every_layer_on_gpu else 1


def check_model_file(path: Path) -> None:
    """What a wrong VERIFIER_MODEL_PATH looks like, found before anything else starts."""
    if not path.is_file():
        raise RuntimeError(
            f"no model file at {path} (VERIFIER_MODEL_PATH): ./scripts/setup.sh prepares "
            "the default pair, scripts/prepare_models.py others"
        )
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise RuntimeError(f"{path} is not a GGUF file (VERIFIER_MODEL_PATH)")


def describe_context(context: ContextChoice) -> str:
    """What decided a session's context, with the setting that changes it."""
    return {
        "asked": "VERIFIER_N_CTX",
        "trained": "the model's trained context",
        "budget": "what VERIFIER_KV_CACHE_MB holds for VERIFIER_MAX_SESSIONS sessions",
    }[context.source]
