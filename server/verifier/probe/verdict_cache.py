"""The startup probe's verdicts kept between starts (VERIFIER_PROBE_CACHE_DIR).

The probe's numerics checks are a function of what they run on: the llama.cpp build, the
model file, the pass shapes and threads the settings give, the device, and the probe's
own code. A start whose inputs are all the same as an earlier one's takes that start's
verdicts instead of decoding the checks again; anything else different (a rebuilt
library, another model file, a setting, another CPU, a change to the probe) is another
key, probed afresh. The timed passes are never kept: a pass's cost is measured at every
start (invariance.probe_engine), since it depends on what else the machine is doing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

from server.shared import batching, runtime
from server.shared.devices import list_devices
from server.shared.runtime import LlamaRuntime
from server.verifier.decoding import decoder, jobs, passes
from server.verifier.decoding.passes import PassShapes
from server.verifier.probe import invariance, prompt_probe, round_probe
from server.verifier.probe.round_probe import InvarianceReport, ProbeTarget
from server.verifier.settings import VerifierSettings

log = logging.getLogger(__name__)

# The code whose change may change a verdict: the probe and what it decodes through.
PROBE_CODE: tuple[ModuleType, ...] = (
    invariance,
    prompt_probe,
    round_probe,
    decoder,
    jobs,
    passes,
    batching,
    runtime,
)
# Variables that steer ggml's kernels or threads.
NUMERICS_ENV_PREFIXES = ("GGML_", "LLAMA_", "OMP_", "CUDA_", "HIP_", "MKL_", "OPENBLAS_")
TIMED_FIELDS = ("pass_cost_rows", "pass_s")  # measured at every start, never kept


def cache_key(facts: Mapping[str, object]) -> str:
    """One name for everything a verdict depends on (pure)."""
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def stored(report: InvarianceReport) -> dict:
    """The report's verdicts as JSON, its timed passes left out (pure)."""
    fields = dataclasses.asdict(report)
    for name in TIMED_FIELDS:
        fields.pop(name)
    return fields


def restored(fields: Mapping[str, object]) -> InvarianceReport:
    """A report from `stored`'s JSON; its timed passes empty (pure). Raises on a file of
    another shape (an older version's: probed again)."""
    known = {f.name for f in dataclasses.fields(InvarianceReport)} - set(TIMED_FIELDS)
    if set(fields) != known:
        raise ValueError(f"fields {sorted(set(fields) ^ known)} differ")
    return InvarianceReport(**fields)  # type: ignore[arg-type]


class VerdictCache:
    """Verdicts in `directory`, one JSON file a key; `facts` describe the runtime."""

    def __init__(self, directory: Path, facts: Mapping[str, object]):
        self.directory, self.facts = directory, dict(facts)

    @classmethod
    def of(cls, directory: str, model: LlamaRuntime) -> VerdictCache | None:
        """The cache the setting names for this runtime; None where it is off ("") or
        the runtime reads no model file."""
        if not directory or not model.model_path.is_file():
            return None
        return cls(Path(directory).expanduser(), runtime_facts(model))

    def path(self, arguments: Mapping[str, object]) -> Path:
        shown = {k: v for k, v in arguments.items() if k != "target"}
        return self.directory / f"{cache_key({**self.facts, 'probe': shown})}.json"

    def read(self, arguments: Mapping[str, object]) -> InvarianceReport | None:
        path = self.path(arguments)
        try:
            report = restored(json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as exc:
            log.warning("the probe's verdicts in %s are unreadable (%s): probing", path, exc)
            return None
        log.info("the startup probe's verdicts from %s (same build, model and shapes)", path)
        return report

    def write(self, arguments: Mapping[str, object], report: InvarianceReport) -> None:
        path = self.path(arguments)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # Written whole then renamed: two verifiers starting at once never read half.
            with tempfile.NamedTemporaryFile(
                "w", dir=self.directory, suffix=".tmp", delete=False
            ) as file:
                json.dump(stored(report), file)
            os.replace(file.name, path)
        except OSError as exc:
            log.warning("could not keep the probe's verdicts in %s: %s", path, exc)


def probe_runtime(
    model: LlamaRuntime, decoder: ProbeTarget, settings: VerifierSettings, reuse: bool
) -> tuple[InvarianceReport, PassShapes]:
    """The engine's probe (invariance.probe_engine), an earlier start's verdicts taken
    where the settings keep them."""
    verdicts = VerdictCache.of(settings.probe_cache_dir, model)
    return invariance.probe_engine(decoder, settings, reuse, verdicts)


def runtime_facts(model: LlamaRuntime) -> dict[str, object]:
    """What a verdict depends on besides the probe's arguments: the build, the model
    file, the context's shapes and threads, the devices, the CPU, the probe's code and
    the variables that steer ggml."""
    stat = model.model_path.stat()
    return {
        "model": [str(model.model_path.resolve()), stat.st_size, stat.st_mtime_ns],
        "context": [
            model.n_seq_max,
            model.n_ctx_per_seq,
            model.n_batch,
            model.n_threads,
            model.single_row_threads,
            model.flash_attn,
            model.n_gpu_layers,
        ],
        "build": _build_files(),
        "devices": [[d.name, d.backend, d.description] for d in list_devices()],
        "cpu": [platform.machine(), *_cpu_model_and_flags()],
        "code": _code_digest(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(NUMERICS_ENV_PREFIXES)},
    }


def _build_files() -> list[object]:
    """llama-cpp-python's version and its libraries (name, size, modification time)."""
    spec = importlib.util.find_spec("llama_cpp")  # located, not imported (runtime.py does)
    version = importlib.metadata.version("llama_cpp_python")
    if spec is None or spec.origin is None:
        return [version]
    lib = Path(spec.origin).parent / "lib"
    files = sorted(lib.glob("*")) if lib.is_dir() else []
    return [version, *([f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files)]


def _cpu_model_and_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return [platform.processor()]
    first = text.split("\n\n", 1)[0]
    fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return [fields.get("model name", ""), fields.get("flags", fields.get("Features", ""))]


def _code_digest() -> str:
    digest = hashlib.sha256()
    for module in PROBE_CODE:
        digest.update(Path(str(module.__file__)).read_bytes())
    return digest.hexdigest()[:32]
