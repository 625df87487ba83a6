#!/usr/bin/env bash
# The device check, in two halves.
#
#   scripts/device-check.sh build [DIR]   on a build machine (no GPU needed): builds ONE stripped
#                                         (and xz-compressed) binary with `--features cuda` (nvcc 13.0 from the package
#                                         registry, see .ci/cuda-env.sh; release in target-cuda/
#                                         unless DEVICE_CHECK_PROFILE=dev and
#                                         DEVICE_CHECK_TARGET_DIR=target, which CI uses to reuse
#                                         its test build), and lays it out in DIR
#                                         (default target/device-check) with the PEFT fixtures, the
#                                         PEFT CUDA bench script and this script; checks DIR < 64 MiB.
#   DIR/device-check.sh run               on the GPU machine: finds the CUDA libraries (the driver's
#                                         libcuda; cuBLAS, cuRAND, NVRTC and the runtime from the
#                                         installed PyTorch or toolkit), runs transformers + PEFT on
#                                         the same workload, then every check and benchmark, and
#                                         prints one summary. Results also go to $OUT when set.
#
# Send the folder to the GPU machine as an ignored path that travels with the tree
# (`carry: ["target/device-check"]`) and run `bash target/device-check/device-check.sh run`.
# Here, without a GPU, `run` is a dry run: it gets as far as "no CUDA device" and exits 2.
set -euo pipefail

MAX_BYTES=$((64 << 20))

build() {
    local root dir
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    dir="${1:-$root/target/device-check}"
    cd "$root"
    # Set up once (CI has already sourced it: then the same environment, so its build is reused).
    if [ -z "${MULTILORA_CUDA_STUBS:-}" ]; then
        # shellcheck source=../.ci/cuda-env.sh
        source .ci/cuda-env.sh
    fi
    # Its own target directory by default, so that target/ keeps the CPU build's binaries;
    # CI passes target/ (DEVICE_CHECK_TARGET_DIR) to reuse its CUDA test build.
    local profile="${DEVICE_CHECK_PROFILE:-release}" target="${DEVICE_CHECK_TARGET_DIR:-target-cuda}" out_dir
    out_dir="$([ "$profile" = dev ] && echo debug || echo "$profile")"
    echo "== building multilora-device-check ($profile, --features cuda, CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP)"
    # Release: the workspace's binaries. Dev (CI): the packages and targets of CI's CUDA test build
    # (MULTILORA_CUDA_PACKAGES, their test targets too, so that the dev-dependencies take part in
    # feature resolution as in `cargo test`): every crate then resolves to the build CI already
    # made, and only the device check's own binary is linked.
    local selection=(--workspace --bins)
    if [ "$profile" = dev ]; then
        # shellcheck disable=SC2206 # cargo's arguments, split on spaces
        selection=(--bins --tests $MULTILORA_CUDA_PACKAGES)
    fi
    cargo build --profile "$profile" --locked --target-dir "$target" "${selection[@]}" \
        --features multilora-cli/cuda,multilora-device-check/cuda
    rm -rf "$dir"
    mkdir -p "$dir/fixtures"
    # Stripped, then compressed: most of the binary is PTX text (candle's kernels and ours),
    # which xz takes from ~55 MiB to ~8 (release).
    strip -o "$dir/multilora-device-check" "$target/$out_dir/multilora-device-check"
    xz -6 -T0 "$dir/multilora-device-check"
    cp -r tests/fixtures/peft-tiny "$dir/fixtures/"
    cp benches/bench_peft_cuda.py "$dir/"
    cp scripts/device-check.sh "$dir/"
    local bytes
    bytes="$(du -sb "$dir" | cut -f1)"
    echo "== laid out $dir: $((bytes / 1024)) KiB"
    if [ "$bytes" -ge "$MAX_BYTES" ]; then
        echo "error: $dir is $bytes bytes, over the 64 MiB that travel to the GPU machine" >&2
        exit 1
    fi
}

# Directories that may hold the CUDA libraries: the driver's, the toolkit's, PyTorch's and the
# nvidia-* wheels', and (for a dry run here) the stub libraries of .ci/cuda-env.sh.
lib_dirs() {
    if [ -n "${MULTILORA_CUDA_STUBS:-}" ]; then
        echo "$MULTILORA_CUDA_STUBS"
    fi
    if [ -n "${CUDA_HOME:-}" ]; then
        echo "$CUDA_HOME/lib"
        echo "$CUDA_HOME/lib64"
    fi
    python3 - <<'PY' 2>/dev/null || true
import glob, os, site, sys
roots = set(site.getsitepackages() + [site.getusersitepackages()])
try:
    import torch
    roots.add(os.path.dirname(os.path.dirname(torch.__file__)))
    print(os.path.join(os.path.dirname(torch.__file__), "lib"))
except Exception:
    pass
for r in sorted(roots):
    for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib")) + glob.glob(os.path.join(r, "nvidia", "cu*", "lib"))):
        print(d)
PY
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-*/lib64 \
        /usr/local/cuda-*/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib/wsl/lib; do
        [ -d "$d" ] && echo "$d"
    done
    ldconfig -p 2>/dev/null | sed -n 's/.* => \(.*\)\/[^/]*$/\1/p' | sort -u
}

run() {
    local dir bin out work
    dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
    bin="$dir/multilora-device-check"
    out="${OUT:-$dir/out}"
    work="${MULTILORA_PEFT_WORKDIR:-${TMPDIR:-/tmp}/multilora-peft-cuda}"
    mkdir -p "$out"
    if [ ! -x "$bin" ] && [ -f "$bin.xz" ]; then
        local tmp="$bin.tmp.$$"
        if command -v xz >/dev/null; then
            xz -dc "$bin.xz" >"$tmp"
        else
            python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$bin.xz" "$tmp"
        fi
        chmod +x "$tmp"
        mv "$tmp" "$bin"
    fi
    [ -x "$bin" ] || { echo "error: $bin is missing: run scripts/device-check.sh build first" >&2; exit 2; }

    echo "== CUDA libraries"
    local needed path="" missing=0
    if command -v readelf >/dev/null; then
        needed="$(readelf -d "$bin" | sed -n 's/.*Shared library: \[\(lib\(cuda\|cublas\|cublasLt\|curand\|nvrtc\|cudart\)\.so[^]]*\)\]/\1/p')"
    else
        needed="libcuda.so.1 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13 libcudart.so.13"
    fi
    local dirs
    dirs="$(lib_dirs | awk '!seen[$0]++')"
    for lib in $needed; do
        local found=""
        for d in $dirs; do
            if [ -e "$d/$lib" ]; then found="$d"; break; fi
        done
        if [ -z "$found" ]; then
            echo "  $lib: NOT FOUND"
            missing=1
        else
            echo "  $lib: $found"
            case ":$path:" in *":$found:"*) ;; *) path="${path:+$path:}$found" ;; esac
        fi
    done
    if [ "$missing" = 1 ]; then
        local driver=0
        for d in $dirs; do
            if [ -e "$d/libcuda.so.1" ]; then driver=1; fi
        done
        if [ "$driver" = 0 ]; then
            echo "error: no CUDA device here: no NVIDIA driver (libcuda.so.1) on this machine" >&2
        else
            echo "error: a CUDA library above was not found (install the CUDA 13 toolkit or a cu13 PyTorch)" >&2
        fi
        exit 2
    fi
    export LD_LIBRARY_PATH="$path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
    fi

    # Probe the device before spending minutes on PEFT: the binary's own first step.
    local probe=0
    "$bin" --fixtures "$dir/fixtures/peft-tiny" --only none >"$out/probe.txt" 2>&1 || probe=$?
    if [ "$probe" = 2 ]; then
        cat "$out/probe.txt" >&2
        exit 2
    fi

    local peft_args=()
    if [ "${MULTILORA_SKIP_PEFT:-0}" != 1 ]; then
        echo "== transformers + PEFT on this GPU (bench_peft_cuda.py)"
        if timeout "${MULTILORA_PEFT_TIMEOUT:-240}" python3 "$dir/bench_peft_cuda.py" --workdir "$work" \
            --json "$out/peft.json" 2>&1 | tee "$out/peft.log" | grep -v "^ " ; then
            [ -s "$out/peft.json" ] && peft_args=(--peft-workdir "$work" --peft-json "$out/peft.json")
        else
            echo "warning: the PEFT bench did not finish; the engine section is skipped" >&2
        fi
    fi

    echo "== multilora-device-check"
    local rc
    set +e
    MULTILORA_REQUIRE_CUDA=1 "$bin" --fixtures "$dir/fixtures/peft-tiny" "${peft_args[@]}" "$@" 2>&1 | tee "$out/summary.txt"
    rc="${PIPESTATUS[0]}"
    set -e
    echo "== results in $out (exit $rc)"
    exit "$rc"
}

case "${1:-}" in
    build) shift; build "$@" ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 build [DIR] | $0 run [multilora-device-check flags]" >&2; exit 2 ;;
esac
