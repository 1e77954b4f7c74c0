#!/usr/bin/env bash
# On a GPU machine with no network, from gpu-kit/ (scripts/gpu/prepare_kit.sh): builds
# llama.cpp's library for the GPU present, installs the wheels, writes random-weight models
# of real sizes, and measures (scripts/gpu/measure.py). Everything it makes is under
# build/gpu/ (kept between calls on a machine held warm: each stage skips what is there).
#
#   ./scripts/gpu/run.sh build              # wheels, libllama with CUDA, the models
#   ./scripts/gpu/run.sh server             # llama.cpp's llama-server too (the peer's figure)
#   ./scripts/gpu/run.sh measure [ARGS]     # scripts/gpu/measure.py ARGS, table under $OUT
#   ./scripts/gpu/run.sh all [ARGS]         # build, then measure
#
# CPU=1 builds for the CPU instead (a rehearsal); LIB=DIR uses a libllama already built
# there (no build); SHAPES (default llama-1b) names the models (make_model.py --shape);
# PYTHON (default python3); OUT (default build/gpu/out) is where the results go.
set -euo pipefail
cd "$(dirname "$0")/../.."

KIT=${KIT:-gpu-kit}
B=build/gpu
OUT=${OUT:-$B/out}
SHAPES=${SHAPES:-llama-1b}
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
say() { echo "[gpu] $(date +%T) $*"; }
# A step's log is under build/gpu, which does not come back from a lent machine: its end
# is printed where the step fails.
logged() {
    local log=$1
    shift
    "$@" >"$log" 2>&1 || { echo "[gpu] failed: $*" >&2; tail -n 60 "$log" >&2; return 1; }
}

[ -f "$KIT/llama.cpp.tar.xz" ] || { echo "[gpu] no $KIT/: run scripts/gpu/prepare_kit.sh first" >&2; exit 1; }
mkdir -p "$B" "$OUT"
export PYTHONPATH="$PWD/$B/site:$PWD/$KIT:$PWD"
KIND=$([ -n "${CPU:-}" ] && echo cpu || echo cuda)  # each build in folders of its own
export LLAMA_CPP_LIB_PATH="${LIB:-$PWD/$B/lib-$KIND}"
export PYTHONUNBUFFERED=1

configure() {
    [ -f "$B/cmake-$KIND/build.ninja" ] && return
    if [ ! -f "$B/llama.cpp/CMakeLists.txt" ]; then
        mkdir -p "$B/llama.cpp"
        tar -xJf "$KIT/llama.cpp.tar.xz" -C "$B/llama.cpp"
    fi
    local backend=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native)
    [ -n "${CPU:-}" ] && backend=()
    say "configuring llama.cpp ($([ -n "${CPU:-}" ] && echo CPU || echo CUDA))"
    logged "$B/configure.log" cmake -S "$B/llama.cpp" -B "$B/cmake-$KIND" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON "${backend[@]}" \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_COMMON=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF
}

build() {
    if ! "$PYTHON" -c 'import pydantic_settings, fastapi, uvicorn, llguidance, lark, gguf, diskcache' 2>/dev/null; then
        say "installing the wheels"
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$B/site" "$KIT"/wheels/*.whl
    fi
    if [ -z "${LIB:-}" ] && [ ! -f "$B/lib-$KIND/libllama.so" ]; then
        configure
        say "building libllama with $JOBS jobs (log: $B/build.log)"
        logged "$B/build.log" cmake --build "$B/cmake-$KIND" --target llama -j "$JOBS"
        mkdir -p "$B/lib-$KIND"
        cp -P "$B"/cmake-$KIND/bin/lib*.so* "$B/lib-$KIND/"
        say "built: $(ls "$B/lib-$KIND" | tr '\n' ' ')"
    fi
    # A library built for the CPU (a rehearsal's, carried along) must not be measured as
    # the GPU's.
    "$PYTHON" -c 'import llama_cpp, sys; offload = bool(llama_cpp.llama_supports_gpu_offload())
print("[gpu] llama_cpp", llama_cpp.__version__, "gpu offload:", offload)
sys.exit(0 if offload or sys.argv[1] else "[gpu] '"$LLAMA_CPP_LIB_PATH"' has no GPU offload: remove it, or CPU=1")' "${CPU:-}"
    for shape in $SHAPES; do
        if [ ! -f "$B/models/$shape.gguf" ]; then
            "$PYTHON" scripts/gpu/make_model.py --vocab "$KIT/vocab.gguf" --shape "$shape" \
                --out "$B/models/$shape.gguf"
        fi
    done
}

server() {
    [ -x "$B/bin-$KIND/llama-server" ] && return
    configure
    say "building llama-server with $JOBS jobs (log: $B/server.log)"
    logged "$B/server.log" cmake --build "$B/cmake-$KIND" --target llama-server -j "$JOBS"
    mkdir -p "$B/bin-$KIND"
    cp "$B/cmake-$KIND/bin/llama-server" "$B/bin-$KIND/"
}

measure() {
    local models=()
    for shape in $SHAPES; do models+=(--model "$B/models/$shape.gguf"); done
    local peer=()
    [ -x "$B/bin-$KIND/llama-server" ] && peer=(--llama-server "$B/bin-$KIND/llama-server")
    "$PYTHON" scripts/gpu/measure.py "${models[@]}" "${peer[@]}" --out "$OUT" "$@"
}

stage=${1:-all}
shift || true
case "$stage" in
build) build ;;
server) server ;;
measure) measure "$@" ;;
all) build && measure "$@" ;;
*) echo "[gpu] unknown stage $stage: build, server, measure or all" >&2; exit 2 ;;
esac
