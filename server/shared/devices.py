"""Where a model computes: the devices this llama.cpp build registered (ggml's backend
registry, read through ctypes on the library the runtime loaded: llama-cpp-python binds
none of it), and a loaded model's placement on them. A build without a GPU backend lists
the CPU alone, which is how a GPU build that silently stayed a CPU build shows."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from server.shared.runtime import LlamaVocab, ggml_library

DEVICE_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


@dataclass(frozen=True, slots=True)
class Device:
    """A device llama.cpp can compute on."""

    name: str  # llama.cpp's name for it: CPU, CUDA0, Metal, ...
    backend: str  # the backend it belongs to: CPU, CUDA, Metal, Vulkan, ...
    description: str  # the hardware: a GPU's or the CPU's model name
    kind: str  # cpu, gpu, igpu (a GPU sharing system memory), accel
    free_bytes: int
    total_bytes: int

    @property
    def is_gpu(self) -> bool:
        return self.kind in ("gpu", "igpu")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a loaded model computes: the backend that holds its offloaded layers (CPU
    where none is), that backend's device, and how many of its layers are there (llama.cpp
    counts the output layer as one more than the model's blocks)."""

    backend: str
    device: str
    gpu_layers: int
    n_layer: int

    def describe(self) -> str:
        if not self.gpu_layers:
            return f"CPU ({self.device})" if self.device else "CPU"
        return f"{self.backend} ({self.device}), {self.gpu_layers} of {self.n_layer + 1} layers"


def placement(found: list[Device], n_gpu_layers: int, n_layer: int) -> Placement:
    """Where llama.cpp puts a model loaded with `n_gpu_layers` (-1: all) on these
    devices: as it counts, at most the model's blocks and its output layer on the first
    GPU, none where the build has no GPU."""
    gpus = [d for d in found if d.is_gpu]
    asked = n_layer + 1 if n_gpu_layers < 0 else n_gpu_layers
    if not gpus or asked == 0:
        cpu = next((d.description for d in found if d.kind == "cpu"), "")
        return Placement("CPU", cpu, 0, n_layer)
    return Placement(gpus[0].backend, gpus[0].description, min(asked, n_layer + 1), n_layer)


def model_placement(model: LlamaVocab) -> Placement:
    """Where a loaded model computes."""
    return placement(list_devices(), model.n_gpu_layers, model.n_layer)


def list_devices(lib: ctypes.CDLL | None = None) -> list[Device]:
    """The devices ggml's registry lists (in `lib`, by default the runtime's ggml)."""
    lib = lib or ggml_library()
    ptr, text, size = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
    signatures = {
        "ggml_backend_dev_count": ([], size),
        "ggml_backend_dev_get": ([size], ptr),
        "ggml_backend_dev_name": ([ptr], text),
        "ggml_backend_dev_description": ([ptr], text),
        "ggml_backend_dev_type": ([ptr], ctypes.c_int),
        "ggml_backend_dev_backend_reg": ([ptr], ptr),
        "ggml_backend_reg_name": ([ptr], text),
        "ggml_backend_dev_memory": ([ptr, ctypes.POINTER(size), ctypes.POINTER(size)], None),
    }
    for name, (args, result) in signatures.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, result

    def decoded(raw: bytes | None) -> str:
        return (raw or b"").decode("utf-8", "replace").strip()

    found = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = size(0), size(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        found.append(
            Device(
                name=decoded(lib.ggml_backend_dev_name(dev)),
                backend=decoded(lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev))),
                description=decoded(lib.ggml_backend_dev_description(dev)),
                kind=DEVICE_KINDS.get(lib.ggml_backend_dev_type(dev), "other"),
                free_bytes=free.value,
                total_bytes=total.value,
            )
        )
    return found
