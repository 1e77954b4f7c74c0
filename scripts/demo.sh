#!/usr/bin/env bash
# Set up, start a verifier on loopback, run the drafter against it, stop the verifier.
# Arguments, if any, go to draft_token_generator instead of the default prompt.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh

# Two processes share this machine: give each half the cores, as two machines would.
cores=$(nproc 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 2)
half=$(( cores / 2 > 0 ? cores / 2 : 1 ))
export VERIFIER_N_THREADS=${VERIFIER_N_THREADS:-$half}
export DRAFTER_THREADS=${DRAFTER_THREADS:-$half}

port=$(.venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log=$(mktemp "${TMPDIR:-/tmp}/verifier.XXXXXX")
echo "[demo] starting the verifier on 127.0.0.1:$port (log: $log)"
# A process group of its own: Ctrl-C reaches the drafter, which ends its session and
# prints what it made; the verifier is stopped after it, by the trap.
set -m  # job control: a background job gets a process group of its own
.venv/bin/uvicorn server.main:app --host 127.0.0.1 --port "$port" --log-level info >"$log" 2>&1 &
server_pid=$!
set +m
stop_server() {
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    rm -f "$log"
}
trap stop_server EXIT
trap 'exit 130' INT TERM

for _ in $(seq 1 600); do
    if ! kill -0 "$server_pid" 2>/dev/null; then
        echo "[demo] the verifier exited:" >&2
        tail -20 "$log" >&2
        exit 1
    fi
    if .venv/bin/python -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/health').status_code != 200)" 2>/dev/null; then
        break
    fi
    sleep 0.2
done
echo "[demo] verifier ready"

if [ "$#" -eq 0 ]; then
    set -- --chat --prompt "Explain in a few sentences why the sky is blue." --max-tokens 80 --baseline
fi
status=0
.venv/bin/draft_token_generator --server "http://127.0.0.1:$port" "$@" || status=$?
exit "$status"
