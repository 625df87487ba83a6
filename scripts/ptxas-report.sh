#!/usr/bin/env bash
# What the GPU's assembler makes of our kernels, before any GPU sees them: each `.cu` file of
# multilora-kernels compiled to SASS for one architecture (sm_90a, H100 / H200, by default) with
# `ptxas -v`, and per entry point its registers, stack frame, spill stores and loads, and static
# shared memory, as one table. Exits 1 when any kernel spills, keeps a stack frame (local memory
# where registers were meant) or takes over 48 KiB of static shared memory; 2 when nvcc is
# missing or a file does not compile.
#
#   scripts/ptxas-report.sh [--arch sm_90a] [--nvcc-flag FLAG]... [FILE.cu...]
#
# Without files, every `crates/multilora-kernels/src/*.cu`. Needs nvcc (`source .ci/cuda-env.sh`).
# CI runs it on our kernels (it must pass) and on a kernel planted to spill
# (`crates/multilora-kernels/tests/planted_spill.cu`, it must fail), so the check itself is
# checked.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
arch=sm_90a
flags=()
files=()
while [ $# -gt 0 ]; do
    case "$1" in
        --arch) arch="$2"; shift 2 ;;
        --nvcc-flag) flags+=("$2"); shift 2 ;;
        *) files+=("$1"); shift ;;
    esac
done
if [ "${#files[@]}" = 0 ]; then
    files=("$root"/crates/multilora-kernels/src/*.cu)
fi
if ! command -v nvcc >/dev/null; then
    echo "error: nvcc not found (source .ci/cuda-env.sh)" >&2
    exit 2
fi

MAX_SMEM=$((48 << 10))
bad=0
printf '%-40s %-52s %5s %6s %7s %7s %7s\n' file "entry point (${arch})" regs stack "spill st" "spill ld" smem
for f in "${files[@]}"; do
    log="$(nvcc -cubin -arch="$arch" -std=c++17 -O3 --expt-relaxed-constexpr -I "$root/crates/multilora-kernels/src" \
        "${flags[@]}" -Xptxas -v -o /dev/null "$f" 2>&1)" || {
        echo "$log" >&2
        echo "error: $f does not compile for $arch" >&2
        exit 2
    }
    # ptxas -v: "Compiling entry function 'NAME'", then "N bytes stack frame, S bytes spill
    # stores, L bytes spill loads", then "Used R registers, ... M bytes smem" (smem only when used).
    rows="$(printf '%s\n' "$log" | awk '
        /Compiling entry function/ { if (name != "") print name, regs, stack, st, ld, smem;
            name = $0; sub(/.*entry function .\047?/, "", name); sub(/\047.*/, "", name);
            regs = 0; stack = 0; st = 0; ld = 0; smem = 0 }
        /bytes stack frame/ { stack = $1; st = $5; ld = $9 }
        /Used [0-9]+ registers/ { for (i = 1; i <= NF; i++) { if ($(i + 1) == "registers,") regs = $i; if ($(i + 1) == "bytes" && $(i + 2) ~ /^smem/) smem = $i } }
        END { if (name != "") print name, regs, stack, st, ld, smem }')"
    while read -r name regs stack st ld smem; do
        [ -n "$name" ] || continue
        flag=""
        if [ "$st" -gt 0 ] || [ "$ld" -gt 0 ]; then flag=" SPILLS"; fi
        if [ "$stack" -gt 0 ]; then flag="$flag STACK"; fi
        if [ "$smem" -gt "$MAX_SMEM" ]; then flag="$flag SMEM>48K"; fi
        if [ -n "$flag" ]; then bad=$((bad + 1)); fi
        printf '%-40s %-52s %5s %6s %7s %7s %7s%s\n' "$(basename "$f")" "${name:0:52}" "$regs" "$stack" "$st" "$ld" "$smem" "$flag"
    done <<<"$rows"
done
if [ "$bad" -gt 0 ]; then
    echo "error: $bad kernel(s) spill, keep a stack frame or take over 48 KiB of shared memory" >&2
    exit 1
fi
echo "ptxas: no spills, no stack frames, shared memory within 48 KiB ($arch)"
