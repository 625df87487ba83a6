#!/usr/bin/env bash
# What the GPU's assembler makes of our kernels, before any GPU sees them: each `.cu` file of
# multilora-kernels compiled to SASS for one architecture (sm_90a, H100 / H200, by default) with
# `ptxas -v` (or, given a `.fatbin` the build made, the PTX it ships, read out with `cuobjdump`
# and assembled by `ptxas -v` alone: what the fatbin's SASS for that architecture was made from,
# without compiling the source again), and per entry point its registers, stack frame, spill
# stores and loads, and static shared memory, as one table. With `cuobjdump` (and its `nvdisasm`) on PATH, the table also counts
# in each entry point's SASS its 128-bit global loads and stores (`LDG.E.128`, `STG.E.128`) and
# its narrower global loads. Exits 1 when any kernel spills, keeps a stack frame (local memory
# where registers were meant) or takes over 48 KiB of static shared memory, or when a kernel of
# the vector paths (the decode-shaped LoRA shrink and expand, split decode attention, the KV
# write: `vec.cuh`'s 16-byte accesses) issues no 128-bit global load; 2 when nvcc is missing, a
# file does not compile, or `--sass` was given (or a fatbin) and cuobjdump is missing.
#
#   scripts/ptxas-report.sh [--arch sm_90a] [--sass] [--nvcc-flag FLAG]... [FILE.cu|FILE.fatbin...]
#
# Without files, every `crates/multilora-kernels/src/*.cu`. CI gives it the fatbins of its CUDA
# build (`target/debug/build/multilora-kernels-*/out/*.fatbin`). Needs nvcc (`source .ci/cuda-env.sh`).
# CI runs it on our kernels (it must pass) and on a kernel planted to spill
# (`crates/multilora-kernels/tests/planted_spill.cu`, it must fail), so the check itself is
# checked.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
arch=sm_90a
sass=0
flags=()
files=()
while [ $# -gt 0 ]; do
    case "$1" in
        --arch) arch="$2"; shift 2 ;;
        --sass) sass=1; shift ;;
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

if command -v cuobjdump >/dev/null && command -v nvdisasm >/dev/null; then
    sass=2
elif [ "$sass" = 1 ]; then
    echo "error: --sass: cuobjdump (with nvdisasm) not found" >&2
    exit 2
fi
for f in "${files[@]}"; do
    if [[ "$f" == *.fatbin ]] && ! command -v cuobjdump >/dev/null; then
        echo "error: $f: a fatbin's PTX is read with cuobjdump, which was not found" >&2
        exit 2
    fi
done
# Entry points of the vector paths, which must issue 128-bit global loads.
VECTOR='^(lora_shrink_bgmv_|lora_expand_bgmv_|paged_decode_split_|paged_kv_write$)'
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

MAX_SMEM=$((48 << 10))
bad=0
nvec=0
printf '%-40s %-52s %5s %6s %7s %7s %7s' file "entry point (${arch})" regs stack "spill st" "spill ld" smem
if [ "$sass" = 2 ]; then printf ' %6s %6s %6s' ldg128 stg128 "ldg<128"; fi
printf '\n'
for f in "${files[@]}"; do
    cubin="$tmp/$(basename "${f%.*}").cubin"
    if [[ "$f" == *.fatbin ]]; then
        # The fatbin's one PTX text (`cuobjdump -xptx` writes it into the current folder).
        abs="$(cd "$(dirname "$f")" && pwd)/$(basename "$f")"
        rm -rf "$tmp/ptx" && mkdir "$tmp/ptx"
        (cd "$tmp/ptx" && cuobjdump -xptx all "$abs" >/dev/null) || { echo "error: cuobjdump cannot read $f" >&2; exit 2; }
        ptx=("$tmp"/ptx/*.ptx)
        if [ "${#ptx[@]}" != 1 ] || [ ! -f "${ptx[0]}" ]; then
            echo "error: $f holds ${#ptx[@]} PTX texts, not one" >&2
            exit 2
        fi
        log="$(ptxas -arch="$arch" -O3 -v -o "$cubin" "${ptx[0]}" 2>&1)" || {
            echo "$log" >&2
            echo "error: the PTX of $f does not assemble for $arch" >&2
            exit 2
        }
    else
        log="$(nvcc -cubin -arch="$arch" -std=c++17 -O3 --expt-relaxed-constexpr -I "$root/crates/multilora-kernels/src" \
            "${flags[@]}" -Xptxas -v -o "$cubin" "$f" 2>&1)" || {
            echo "$log" >&2
            echo "error: $f does not compile for $arch" >&2
            exit 2
        }
    fi
    # ptxas -v: "Compiling entry function 'NAME'", then "N bytes stack frame, S bytes spill
    # stores, L bytes spill loads", then "Used R registers, ... M bytes smem" (smem only when used).
    rows="$(printf '%s\n' "$log" | awk '
        /Compiling entry function/ { if (name != "") print name, regs, stack, st, ld, smem;
            name = $0; sub(/.*entry function .\047?/, "", name); sub(/\047.*/, "", name);
            regs = 0; stack = 0; st = 0; ld = 0; smem = 0 }
        /bytes stack frame/ { stack = $1; st = $5; ld = $9 }
        /Used [0-9]+ registers/ { for (i = 1; i <= NF; i++) { if ($(i + 1) == "registers,") regs = $i; if ($(i + 1) == "bytes" && $(i + 2) ~ /^smem/) smem = $i } }
        END { if (name != "") print name, regs, stack, st, ld, smem }')"
    # cuobjdump -sass: a "Function : NAME" line opens each entry point's code.
    loads=""
    if [ "$sass" = 2 ]; then
        loads="$(cuobjdump -sass "$cubin" | awk '
            /Function :/ { if (name != "") print name, l128, s128, lnarrow; name = $3; l128 = 0; s128 = 0; lnarrow = 0 }
            /LDG\.E[.A-Z0-9]*\.128/ { l128++; next }
            /STG\.E[.A-Z0-9]*\.128/ { s128++; next }
            /LDG\.E/ { lnarrow++ }
            END { if (name != "") print name, l128, s128, lnarrow }')"
    fi
    while read -r name regs stack st ld smem; do
        [ -n "$name" ] || continue
        flag=""
        if [ "$st" -gt 0 ] || [ "$ld" -gt 0 ]; then flag=" SPILLS"; fi
        if [ "$stack" -gt 0 ]; then flag="$flag STACK"; fi
        if [ "$smem" -gt "$MAX_SMEM" ]; then flag="$flag SMEM>48K"; fi
        sass_cols=""
        if [ "$sass" = 2 ]; then
            read -r l128 s128 lnarrow < <(awk -v n="$name" '$1 == n { print $2, $3, $4; found = 1 } END { if (!found) print "?", "?", "?" }' <<<"$loads")
            sass_cols="$(printf ' %6s %6s %6s' "$l128" "$s128" "$lnarrow")"
            if [[ "$name" =~ $VECTOR ]]; then
                nvec=$((nvec + 1))
                if ! [ "$l128" -gt 0 ] 2>/dev/null; then flag="$flag NO-LDG.128"; fi
            fi
        fi
        if [ -n "$flag" ]; then bad=$((bad + 1)); fi
        printf '%-40s %-52s %5s %6s %7s %7s %7s%s%s\n' "$(basename "$f")" "${name:0:52}" "$regs" "$stack" "$st" "$ld" "$smem" "$sass_cols" "$flag"
    done <<<"$rows"
done
if [ "$bad" -gt 0 ]; then
    echo "error: $bad kernel(s) spill, keep a stack frame, take over 48 KiB of shared memory or (a vector path) issue no 128-bit global load" >&2
    exit 1
fi
echo "ptxas: no spills, no stack frames, shared memory within 48 KiB ($arch)"
if [ "$sass" = 2 ]; then
    echo "sass: each of the $nvec vector-path kernels issues 128-bit global loads ($arch)"
fi
