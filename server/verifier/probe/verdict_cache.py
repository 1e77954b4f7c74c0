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
# Libraries a pass's numbers may come from, besides llama-cpp-python's own: the C and
# C++ runtimes' maths, OpenMP, and the GPU and BLAS stacks (a driver's library carries
# its version in its name).
NUMERICS_LIBRARIES = (
    "libggml",
    "libllama",
    "libc.so",
    "libm.so",
    "libstdc++",
    "libgomp",
    "libomp",
    "libiomp",
    "libcuda",
    "libcublas",
    "libnvidia",
    "libnvrtc",
    "libvulkan",
    "libMoltenVK",
    "libamdhip",
    "libhip",
    "librocblas",
    "libmkl",
    "libopenblas",
    "libblas",
    "libsycl",
)


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
    another shape (an older version's: probed again) or a value of another type."""
    kinds = {
        f.name: type(f.default) if f.default is not dataclasses.MISSING else f.type
        for f in dataclasses.fields(InvarianceReport)
        if f.name not in TIMED_FIELDS
    }
    if set(fields) != set(kinds):
        raise ValueError(f"fields {sorted(set(fields) ^ set(kinds))} differ")
    for name, value in fields.items():
        if not _of_kind(value, kinds[name]):
            raise ValueError(f"{name} is {value!r}")
    return InvarianceReport(**fields)  # type: ignore[arg-type]


def _of_kind(value: object, kind: object) -> bool:
    """JSON's value for a report field: a bool is no number, an int may stand for a float."""
    if kind in (bool, "bool"):
        return isinstance(value, bool)
    if kind in (int, "int"):
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
            if path.stat().st_uid != os.getuid():
                # Another user's file in a shared folder could vouch for passes that differ.
                raise ValueError("the file is another user's")
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
        # A file written again, copied over or renamed into place changes one of these.
        "model": [
            str(model.model_path.resolve()),
            stat.st_size,
            stat.st_mtime_ns,
            stat.st_ctime_ns,
            stat.st_ino,
        ],
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
        "libraries": _numerics_libraries(),
        "system": platform.platform(),
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


def _numerics_libraries() -> list[object]:
    """Each library of NUMERICS_LIBRARIES this process has loaded (path, size, times):
    a driver, CUDA or C library updated in place is another key. Read where the system
    lists a process's mappings (Linux); elsewhere the build's own files stand for them."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    paths = sorted({line.split()[-1] for line in lines if line.count(" ") >= 5})
    found: list[object] = []
    for name in paths:
        path = Path(name)
        if path.name.startswith(NUMERICS_LIBRARIES) and ".so" in path.name:
            try:
                stat = path.stat()
            except OSError:
                continue
            found.append([name, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns])
    return found


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
