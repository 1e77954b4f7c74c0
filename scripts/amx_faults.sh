#!/usr/bin/env bash
# Exits 0 where this CPU advertises AMX and a tiny AMX program faults on it, printing the
# compiler flags that build without AMX (before -march=native, they stay in force); 1 elsewhere.
# llama.cpp's CPU build takes every instruction the compiler finds here (-march=native),
# AMX included where the CPU advertises it; some virtual machines advertise AMX and fault
# on its first instruction (SIGILL in the first matrix product). setup.sh and
# build_llama_server.sh build llama.cpp without AMX where this says so.
set -uo pipefail

[ "$(uname -s)-$(uname -m)" = Linux-x86_64 ] || exit 1
grep -qw amx_int8 /proc/cpuinfo 2>/dev/null || exit 1
command -v cc >/dev/null || exit 1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cat >"$dir/amx.c" <<'C'
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned char config[64];
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */))
        return 1;
    memset(config, 0, sizeof config);
    config[0] = 1;   /* palette 1 */
    config[16] = 64; /* tile 0: 64 bytes a row */
    config[48] = 16; /* tile 0: 16 rows */
    _tile_loadconfig(config);
    _tile_zero(0);
    _tile_release();
    return 0;
}
C
cc -O1 -mamx-tile "$dir/amx.c" -o "$dir/amx" 2>/dev/null || exit 1  # no AMX in this compiler
("$dir/amx" >/dev/null; exit $?) 2>/dev/null && exit 1  # its shell reports the fault, quietly
echo "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
exit 0
