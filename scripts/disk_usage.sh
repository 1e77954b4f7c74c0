#!/usr/bin/env bash
# What this checkout takes on disk once set up: the virtual environment (the packages of
# the EXTRAS it was set up with), the prepared models and their downloads, and the total.
set -euo pipefail
cd "$(dirname "$0")/.."

size() { if [ -e "$1" ]; then du -sm "$1" | cut -f1; else echo 0; fi; }
total=0
for path in .venv models/*.gguf models/.cache; do
    [ -e "$path" ] || continue
    mb=$(size "$path")
    total=$((total + mb))
    printf '%6d MB  %s\n' "$mb" "$path"
done
printf '%6d MB  in all\n' "$total"
