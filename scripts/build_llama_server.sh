#!/usr/bin/env bash
# Builds llama.cpp's own `llama-server` from the llama.cpp that the installed
# llama-cpp-python vendors (the same kernels the verifier runs), for the comparisons of
# scripts/bench_tasks.py --llama-server. CPU only, native instructions; about ten minutes
# on two cores. Never run by the tests or CI.
#
#   ./scripts/build_llama_server.sh                 # pip-downloads the installed version's sdist
#   ./scripts/build_llama_server.sh SOURCE          # a llama-cpp-python sdist (.tar.gz), the
#                                                   # folder it unpacks to, or a llama.cpp folder
#
# The binary lands in build/llama-server/bin/llama-server (build/ is ignored by git).
# JOBS (default: the cores this process may use) and CMAKE_ARGS (added last) pass through.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=build/llama-server
PYTHON=${PYTHON:-.venv/bin/python}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
say() { echo "[llama-server] $*"; }

version=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')
source=${1:-}
mkdir -p "$OUT"

if [ -z "$source" ]; then
    say "downloading the llama-cpp-python $version sdist (77 MB)"
    "$PYTHON" -m pip download --disable-pip-version-check -q --no-binary :all: --no-deps \
        --dest "$OUT/sdist" "llama-cpp-python==$version"
    source=$(ls "$OUT"/sdist/llama_cpp_python-"$version".tar.gz)
fi

given=$source
if [ -f "$source" ]; then
    say "unpacking $source"
    rm -rf "$OUT/src"
    mkdir -p "$OUT/src"
    tar -xzf "$source" -C "$OUT/src" --strip-components=1
    source="$OUT/src"
fi

if [ -f "$source/vendor/llama.cpp/CMakeLists.txt" ]; then
    llama_dir="$source/vendor/llama.cpp"  # a llama-cpp-python source tree
elif [ -f "$source/tools/server/CMakeLists.txt" ]; then
    llama_dir="$source"  # llama.cpp itself
else
    echo "[llama-server] $source is neither a llama-cpp-python sdist nor llama.cpp" >&2
    exit 1
fi
case "$given" in
*"$version"*) ;;
*) say "note: $given does not name version $version: its llama.cpp may differ from the installed one" ;;
esac

if no_amx=$(./scripts/amx_faults.sh); then
    say "this CPU advertises AMX but faults on it: built without AMX"
    export CFLAGS="${CFLAGS:-} $no_amx" CXXFLAGS="${CXXFLAGS:-} $no_amx"
fi

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
say "configuring $llama_dir"
# No web UI (its assets would be downloaded or built with npm), no HTTPS, no downloads.
# shellcheck disable=SC2086
cmake -S "$llama_dir" -B "$OUT/cmake" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    ${CMAKE_ARGS:-} >"$OUT/configure.log"
say "building llama-server with $JOBS job(s): about ten minutes on two cores (log: $OUT/build.log)"
cmake --build "$OUT/cmake" --target llama-server -j "$JOBS" >"$OUT/build.log"

mkdir -p "$OUT/bin"
cp "$OUT/cmake/bin/llama-server" "$OUT/bin/llama-server"
# The unpacked sources are not needed once built (their docs name paths of llama.cpp's tree).
rm -rf "$OUT/src" "$OUT/sdist"
echo "$version" >"$OUT/bin/VERSION"
say "built $OUT/bin/llama-server (llama-cpp-python $version's llama.cpp)"
"$OUT/bin/llama-server" --version 2>&1 | sed 's/^/[llama-server] /' || true
