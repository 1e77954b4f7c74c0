#!/usr/bin/env bash
# Idempotent setup: .venv, an editable install, this machine's side of a model pair.
# EXTRAS picks what is installed: test (the default: verifier, drafter, serve and the test
# tools, and both models), server (a verifier machine: the verifier's model), drafter or
# serve (a Mac: the drafter's model). PAIR picks the pair (models/manifest.json). CMAKE_ARGS passes through
# to the llama-cpp-python build, e.g. CMAKE_ARGS="-DGGML_CUDA=on" on a CUDA server (Metal
# is on by default on Apple Silicon).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-test}
say() { echo "[setup] $*"; }

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || { echo "[setup] Python >= 3.11 is needed ($PYTHON is $("$PYTHON" --version))" >&2; exit 1; }
    say "creating .venv with $("$PYTHON" --version)"
    "$PYTHON" -m venv .venv
fi

# Some virtual machines advertise AMX and fault on it (scripts/amx_faults.sh says where).
rebuild=() no_amx=""
if no_amx=$(./scripts/amx_faults.sh); then
    say "this CPU advertises AMX but faults on it: llama.cpp is built without AMX"
    export CFLAGS="${CFLAGS:-} $no_amx" CXXFLAGS="${CXXFLAGS:-} $no_amx"
    # A build made with AMX, installed or in pip's cache (where a drafter's install, as the
    # tests make one, would take it), is not taken again; the new build is cached instead.
    if [ ! -f .venv/.llama-cpp-no-amx ]; then
        .venv/bin/python -m pip cache remove 'llama_cpp_python*' >/dev/null 2>&1 || true
        if .venv/bin/python -c 'import llama_cpp' 2>/dev/null; then
            rebuild=(--force-reinstall --no-deps "llama-cpp-python>=0.3.36,<0.4")
        fi
    fi
fi

# A GPU build is what was asked for, or it is not done: pip would otherwise keep an
# installed CPU build ("Requirement already satisfied") or reuse its cached CPU wheel.
gpu=""
case " ${CMAKE_ARGS:-} " in
    *GGML_CUDA=[Oo][Nn]*|*GGML_CUDA=1*) gpu=CUDA ;;
    *GGML_METAL=[Oo][Nn]*|*GGML_METAL=1*) gpu=Metal ;;
    *GGML_HIP=[Oo][Nn]*|*GGML_VULKAN=[Oo][Nn]*|*GGML_SYCL=[Oo][Nn]*) gpu=GPU ;;
esac
if [ -z "$gpu" ] && [ "$(uname -s)-$(uname -m)" = "Darwin-arm64" ]; then
    gpu=Metal  # llama.cpp's default on Apple Silicon
fi
if [ "$gpu" = CUDA ] && ! command -v nvcc >/dev/null && [ -z "${CUDACXX:-}" ] \
    && [ ! -x /usr/local/cuda/bin/nvcc ]; then
    echo "[setup] CMAKE_ARGS asks for CUDA, but no CUDA compiler is here (nvcc on PATH," \
        "CUDACXX, /usr/local/cuda/bin/nvcc): install the CUDA toolkit first" \
        "(docs/gpu-server-and-mac.md)" >&2
    exit 1
fi
offloads() { .venv/bin/python -c 'import sys, llama_cpp; sys.exit(not llama_cpp.llama_supports_gpu_offload())' 2>/dev/null; }
gpu_build_failed() {
    echo "[setup] llama-cpp-python did not build for $gpu (the log is above). Built on a" \
        "machine without the GPU, CMake cannot detect its architecture: name it, e.g." \
        "CMAKE_ARGS=\"-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90\" (H100/H200; 80 for" \
        "A100, 121 for GB10). The toolkit needs its libraries too (cuBLAS)." \
        "docs/gpu-server-and-mac.md" >&2
    exit 1
}
# llama-cpp-python also builds llama.cpp's common library and its multimodal one (mtmd),
# most of its compile time: llama_cpp loads neither (mtmd only in its llava chat
# handlers), nor does this project. Left out (scripts/llama_lean.cmake); the libraries it
# loads are built as before.
asked_cmake_args=${CMAKE_ARGS:-}
export CMAKE_ARGS="-DLLAVA_BUILD=OFF -DCMAKE_PROJECT_INCLUDE=\"$PWD/scripts/llama_lean.cmake\"${asked_cmake_args:+ $asked_cmake_args}"
if [ -n "$gpu" ]; then
    # Never a wheel pip cached from an earlier (CPU) build.
    export PIP_NO_CACHE_DIR=1 PIP_NO_BINARY=llama-cpp-python
fi
if [ -n "$gpu" ] && .venv/bin/python -c 'import llama_cpp' 2>/dev/null && ! offloads; then
    # pip keeps the installed build until the new one is built: a failed build leaves the
    # venv as it was.
    say "the installed llama-cpp-python has no GPU backend: it builds again for $gpu" \
        "(about 5 minutes on 2 cores)"
    .venv/bin/python -m pip install --disable-pip-version-check -q --force-reinstall \
        --no-deps "llama-cpp-python>=0.3.36,<0.4" || gpu_build_failed
    rebuild=()
fi

# Reinstall only when the project's dependencies change.
stamp=".venv/.installed-$(cat pyproject.toml | sha256sum | cut -c1-16)-$EXTRAS-$asked_cmake_args"
stamp+=${no_amx:+-no-amx}
stamp=${stamp// /_}
if [ ! -f "$stamp" ]; then
    say "installing hetero-specdecode[$EXTRAS] and its dependencies"
    if ! .venv/bin/python -c 'import llama_cpp' 2>/dev/null; then
        say "llama-cpp-python builds from source: about 5 minutes on 2 cores, once"
    fi
    .venv/bin/python -m pip install --disable-pip-version-check -q --upgrade pip
    if [ ${#rebuild[@]} -gt 0 ]; then
        say "llama-cpp-python builds again, without AMX: about 5 minutes on 2 cores"
        .venv/bin/python -m pip install --disable-pip-version-check -q "${rebuild[@]}"
    fi
    if [ -n "$gpu" ]; then
        .venv/bin/python -m pip install --disable-pip-version-check -e ".[$EXTRAS]" \
            || gpu_build_failed
    else
        .venv/bin/python -m pip install --disable-pip-version-check -e ".[$EXTRAS]"
    fi
    if [ -n "$no_amx" ]; then touch .venv/.llama-cpp-no-amx; fi
    rm -f .venv/.installed-*
    touch "$stamp"
else
    say "dependencies up to date"
fi
if [ -n "$gpu" ] && ! offloads; then
    echo "[setup] llama-cpp-python was built without a GPU backend although $gpu was asked" \
        "for: see the build log above (pip install -v) and docs/gpu-server-and-mac.md" >&2
    exit 1
fi
if [ -n "$gpu" ]; then
    say "llama.cpp's devices: $(.venv/bin/python -c 'from server.shared.devices import list_devices
print(", ".join(f"{d.name} ({d.description})" for d in list_devices()))')"
fi

# Each machine prepares its own side's model: a verifier's (EXTRAS=server), a drafter's
# (EXTRAS=drafter or serve), or both (the tests). PAIR names a pair of models/manifest.json.
case ",$EXTRAS," in
    *,test,*) side=both ;;
    *,server,*) side=verifier ;;
    *,drafter,*|*,serve,*) side=drafter ;;
    *) side=both ;;
esac
.venv/bin/python scripts/prepare_models.py --side "$side" ${PAIR:+--pair "$PAIR"}
