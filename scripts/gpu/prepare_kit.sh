#!/usr/bin/env bash
# Prepares gpu-kit/ (ignored by git): what a GPU machine with no network needs to build
# and measure the verifier there (scripts/gpu/run.sh), in well under 64 MiB:
#   llama.cpp.tar.xz   the llama.cpp that the installed llama-cpp-python vendors, without
#                      the other backends' sources, the web UI and the models
#   llama_cpp/         llama-cpp-python's Python package (the library is built there)
#   wheels/            the Python packages such a machine lacks (Python 3.12, x86-64)
#   vocab.gguf         the default verifier's vocabulary (scripts/gpu/make_model.py
#                      writes random-weight models of real sizes around it)
# Needs the package index (PyPI) here; run once, again after a dependency changes.
#
#   ./scripts/gpu/prepare_kit.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

KIT=${KIT:-gpu-kit}
PYTHON=${PYTHON:-.venv/bin/python}
WORK=build/gpu-kit-src
say() { echo "[gpu-kit] $*"; }

version=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')
mkdir -p "$WORK" "$KIT"
sdist="$WORK/llama_cpp_python-$version.tar.gz"
if [ ! -f "$sdist" ]; then
    say "downloading the llama-cpp-python $version sdist"
    "$PYTHON" -m pip download --disable-pip-version-check -q --no-binary :all: --no-deps \
        --dest "$WORK" "llama-cpp-python==$version"
fi
rm -rf "$WORK/src" && mkdir -p "$WORK/src"
tar -xzf "$sdist" -C "$WORK/src" --strip-components=1

say "llama.cpp sources (CPU and CUDA backends, the server, no UI)"
llama="$WORK/src/vendor/llama.cpp"
others=(vulkan sycl metal opencl cann musa hip webgpu hexagon openvino et virtgpu zdnn rpc blas kompute)
excludes=()
for backend in "${others[@]}"; do excludes+=(--exclude="ggml/src/ggml-$backend"); done
tar -cJf "$KIT/llama.cpp.tar.xz" -C "$llama" "${excludes[@]}" \
    --exclude=tools/ui/src --exclude=tools/ui/static --exclude=tools/ui/tests \
    --exclude=tools/ui/package-lock.json --exclude='*.gguf' \
    CMakeLists.txt cmake scripts ggml src include common tools vendor licenses LICENSE
echo "$version" >"$KIT/VERSION"

say "llama-cpp-python's Python package"
rm -rf "$KIT/llama_cpp"
cp -r "$WORK/src/llama_cpp" "$KIT/llama_cpp"
rm -rf "$KIT/llama_cpp/server"

say "wheels for Python 3.12, x86-64 (the versions installed here)"
rm -rf "$KIT/wheels" && mkdir -p "$KIT/wheels"
# Every package the verifier, the drafter's harness and the scripts import, with what they
# need, but numpy (PyTorch's machines have it): checked as a closure below.
packages=(pydantic pydantic_core pydantic-settings annotated-types typing-inspection
    typing_extensions python-dotenv fastapi starlette annotated-doc anyio uvicorn llguidance
    lark gguf diskcache opentelemetry-api click h11 prometheus_client httpx httpcore certifi
    idna urllib3 PyYAML requests charset_normalizer tqdm jinja2 MarkupSafe typer rich
    shellingham markdown-it-py mdurl pygments sniffio)
pins=()
for name in "${packages[@]}"; do
    pins+=("$name==$("$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")")
done
"$PYTHON" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
    -d "$KIT/wheels" "${pins[@]}"

say "checking that the wheels need nothing else (but numpy) on Python 3.12"
"$PYTHON" scripts/gpu/check_wheels.py "$KIT/wheels" --present numpy

say "the default verifier's vocabulary"
"$PYTHON" - "$KIT/vocab.gguf" <<'EOF'
import sys
from server.shared.defaults import DEFAULT_VERIFIER_MODEL
from server.verifier.decoding.vocab_file import vocab_only_gguf
open(sys.argv[1], "wb").write(vocab_only_gguf(DEFAULT_VERIFIER_MODEL))
EOF
rm -rf "$WORK/src"  # the unpacked sdist: what the kit needs of it is in the kit
say "$(du -sh "$KIT" | cut -f1) in $KIT (carry it: run.sh reads it from there)"
