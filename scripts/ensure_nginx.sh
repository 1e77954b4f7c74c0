#!/usr/bin/env bash
# The balancer tests run a real nginx: install it where it is missing and this machine
# can (Debian's apt-get as root, or Homebrew). Where it cannot, say why and go on: the
# tests that need it then fail with the same reason, they are never skipped.
set -uo pipefail

say() { echo "[setup] $*"; }
have_nginx() {
    command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || [ -x /usr/local/sbin/nginx ]
}

have_nginx && exit 0
if command -v apt-get >/dev/null 2>&1; then
    apt=(apt-get)
    if [ "$(id -u)" != 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            apt=(sudo apt-get)
        else
            say "nginx is missing and installing it needs root: apt-get install nginx"
            exit 0
        fi
    fi
    say "installing nginx with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    "${apt[@]}" install -y -q nginx >/dev/null \
        || { "${apt[@]}" update -q >/dev/null && "${apt[@]}" install -y -q nginx >/dev/null; } \
        || say "apt-get could not install nginx"
elif command -v brew >/dev/null 2>&1; then
    say "installing nginx with Homebrew"
    brew install nginx >/dev/null || say "brew could not install nginx"
else
    say "nginx is missing and there is no package manager here to install it with"
fi
have_nginx || say "nginx is still missing: the balancer tests will fail and say so"
exit 0
