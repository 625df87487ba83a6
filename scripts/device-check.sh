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
#                                         PEFT CUDA bench script, build-info.txt and this script;
#                                         checks DIR < 64 MiB.
#   DIR/device-check.sh run [FLAGS]       on the GPU machine, in at most 8 minutes (FLAGS go to
#                                         each of the binary's sections, e.g. --quick):
#     1. a preflight: nvidia-smi, the driver, and each CUDA library the binary links (cuBLAS,
#        cuBLASLt, cuRAND, NVRTC, the runtime) found or named as missing with where it looked;
#        a missing library does not stop the run (PEFT still runs; the binary's sections say
#        why they could not);
#     2. the sections, each in its own process under its own timeout (budgets below), the
#        modules' loading (`jit`) and the kernels first, the PEFT bench and the engine last; a section that failed (not one that only
#        missed a speed target) is rerun once with CUDA_LAUNCH_BLOCKING=1 (the binary under
#        compute-sanitizer's memcheck where the image has it), and one that timed
#        out once with a longer budget when the sections after it keep theirs; both results
#        are reported;
#     3. one summary table (section, status, time / budget, key figures as measured / floor),
#        $OUT/summary.txt and $OUT/device-check.json, and every file of the run (the preflight,
#        each section's log, key and report) in one archive beside them, $OUT/device-check.tar.gz:
#        fetch those three.
#   Exit status: 0 all passed; 1 a section failed, timed out or could not run; 2 no CUDA device
#   (before any section); 3 only speed targets missed.
#
# Send the folder to the GPU machine as an ignored path that travels with the tree
# (`carry: ["target/device-check"]`) and run `bash target/device-check/device-check.sh run`.
# Here, without a GPU, `run` is a dry run: it prints the preflight and the sections, gets as far
# as "no CUDA device", writes the summary, the JSON and the archive, and exits 2. The preflight
# searches the loader's path (LD_LIBRARY_PATH), /usr/local/nvidia, the toolkit's, PyTorch's and
# the system's folders for each library, lists every folder it searched, and asks the loader and
# the driver themselves (`cuInit`): a driver the loader opens counts wherever it is.
#
# For the script's own tests (crates/multilora-device-check/tests/script.rs), without a GPU:
#   DEVICE_CHECK_STUB=CMD          every section, and the device probe, runs
#                                  `CMD SECTION PREFIX COMMAND...` instead of COMMAND (the binary
#                                  or the PEFT bench; PREFIX: where the binary would write
#                                  PREFIX.json and PREFIX.key);
#   DEVICE_CHECK_BUDGETS=a=S,b=S   per-section budgets in seconds; DEVICE_CHECK_TOTAL=S the total;
#   DEVICE_CHECK_SANITIZER=PATH    the compute-sanitizer to rerun a failed section under (else
#                                  found on PATH, in $CUDA_HOME/bin or /usr/local/cuda*/bin;
#                                  `none`: no sanitizer).
set -euo pipefail

MAX_BYTES=$((64 << 20))

# The sections in the order they run, with their budgets in seconds: 445 s of the 480, the
# rest for the preflight, the probe and reruns (a rerun spends from the same 480 s, so the
# sections after it get what is left: PEFT and the engine come last). `replay` comes first: our
# kernels against the emulator's recorded launches with nothing but the driver (it runs, as PEFT
# does, when the binary cannot start). Then `jit`: it loads
# our fatbins and has the driver compile candle's PTX into its cache, so that no later section
# pays for that compile inside its own budget.
SECTIONS=(replay:20 jit:45 kernels:60 timing:40 golden:40 decode:50 gguf:40 peft:100 engine:50)
TOTAL_BUDGET=480
# Below this many seconds left, a section or a rerun is not started.
MIN_START=5

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
    # Stripped, then compressed: most of the binary is candle's PTX text and our fatbins, which
    # xz takes from ~60 MiB to ~12 (release).
    strip -o "$dir/multilora-device-check" "$target/$out_dir/multilora-device-check"
    xz -6 -T0 "$dir/multilora-device-check"
    cp -r tests/fixtures/peft-tiny "$dir/fixtures/"
    replay_build "$dir/replay" "$target/$out_dir/multilora-device-check"
    cp benches/bench_peft_cuda.py "$dir/"
    cp scripts/device-check.sh "$dir/"
    {
        echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (modified)')"
        echo "profile $profile, CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP, $(nvcc --version 2>/dev/null | sed -n 's/.*\(release [0-9.]*\).*/nvcc \1/p')"
    } >"$dir/build-info.txt"
    local bytes
    bytes="$(du -sb "$dir" | cut -f1)"
    echo "== laid out $dir: $((bytes / 1024)) KiB"
    if [ "$bytes" -ge "$MAX_BYTES" ]; then
        echo "error: $dir is $bytes bytes, over the 64 MiB that travel to the GPU machine" >&2
        exit 1
    fi
}

# The device replay in $1 (crates/multilora-kernels/src/emulate/replay.cpp): our kernels run from
# their fatbins (written by the binary $2) on launches the emulator recorded, with nothing but the
# driver, so that an image the binary cannot start on still has them checked. The corpus is
# $DEVICE_CHECK_CORPUS when given (CI records it during its test run), else recorded here by the
# emulated kernel tests (`MULTILORA_EMU_RECORD`). The source goes too, to be built there again if
# this build of it cannot start.
replay_build() {
    local rp="$1" bin="$2" src=crates/multilora-kernels/src
    mkdir -p "$rp/src/emulate"
    cp "$src/params.h" "$rp/src/"
    cp "$src/emulate/replay.cpp" "$src/emulate/kernels.h" "$src/emulate/fix_ptrs.h" "$rp/src/emulate/"
    replay_compile "${CXX:-c++}" "$rp/src/emulate/replay.cpp" "$rp/replay"
    "$bin" --fixtures tests/fixtures/peft-tiny --write-fatbins "$rp/fatbins"
    if ! compgen -G "$rp/fatbins/*.fatbin" >/dev/null; then
        echo "error: $bin wrote no fatbin for the replay" >&2
        exit 1
    fi
    xz -6 -T0 "$rp"/fatbins/*.fatbin
    if [ -n "${DEVICE_CHECK_CORPUS:-}" ]; then
        cp -r "$DEVICE_CHECK_CORPUS" "$rp/corpus"
    else
        echo "== recording the emulated kernel tests' launches for the replay"
        MULTILORA_EMU_RECORD="$rp/corpus" MULTILORA_REQUIRE_EMULATION=1 \
            cargo test --locked -q -p multilora-layers --lib -- emulated >/dev/null
    fi
    local n
    n="$(find "$rp/corpus" -name '*.launch' 2>/dev/null | wc -l)"
    if [ "$n" -eq 0 ]; then
        echo "error: no recorded launch in $rp/corpus for the replay" >&2
        exit 1
    fi
    echo "== the replay: $n launches of $(find "$rp/corpus" -name '*.launch' -printf '%f\n' | cut -d. -f1 | sort -u | wc -l) kernels, $(($(du -sb "$rp/corpus" | cut -f1) / 1024)) KiB"
}

# Builds the replay's source $2 into $3 with the C++ compiler $1 (here, and there again when the
# carried build cannot start).
replay_compile() {
    "$1" -std=c++17 -O2 -o "$3" "$2" -ldl
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
    # The loader's own path first, as it searches it: container and VM images often mount the
    # driver there (or under /usr/local/nvidia, below) and nowhere else.
    local d
    local IFS=':'
    for d in ${LD_LIBRARY_PATH:-}; do
        if [ -n "$d" ] && [ -d "$d" ]; then echo "$d"; fi
    done
    unset IFS
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
    for d in /usr/local/nvidia/lib /usr/local/nvidia/lib64 /usr/local/cuda/lib64 \
        /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-*/lib64 /usr/local/cuda-*/targets/x86_64-linux/lib \
        /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib/wsl/lib; do
        if [ -d "$d" ]; then echo "$d"; fi
    done
    ldconfig -p 2>/dev/null | sed -n 's/.* => \(.*\)\/[^/]*$/\1/p' | sort -u
}

now_ms() { echo $(($(date +%s%N) / 1000000)); }
# Milliseconds as seconds with one decimal.
fmt_s() { printf '%d.%d' $(($1 / 1000)) $(($1 % 1000 / 100)); }

# A JSON string of $1 (control characters other than tab and newline dropped).
json_str() {
    local s="$1"
    s="${s//\\/\\\\}"
    s="${s//\"/\\\"}"
    s="${s//$'\t'/\\t}"
    s="${s//$'\n'/\\n}"
    s="$(printf '%s' "$s" | tr -d '\000-\010\013-\037')"
    printf '"%s"' "$s"
}

# The file $1 as embedded JSON if it holds any, else null.
json_file() {
    if [ -s "$1" ]; then cat "$1"; else printf 'null'; fi
}

# The last $2 non-empty lines of $1, for a section that left no key figures.
last_lines() {
    awk -v n="$2" 'NF { l[++c] = $0 }
        END { if (c == 0) print "no output"; for (i = (c > n ? c - n + 1 : 1); i <= c; i++) print "last output: " substr(l[i], 1, 100) }' "$1" 2>/dev/null || true
}

# A section's status from its exit status.
status_of() {
    case "$1" in
        0) echo pass ;;
        1) echo FAIL ;;
        2) echo "no device" ;;
        3) echo slow ;;
        124 | 137) echo timeout ;;
        *) echo "crash rc=$1" ;;
    esac
}

# How a run with exit status $1 is rerun: `blocking` (a failure or a crash: once more with
# CUDA_LAUNCH_BLOCKING=1, which names the launch that failed), `longer` (a timeout: once more with
# a longer budget when the sections after it keep theirs, the driver's compile of the kernels
# then cached), or `none` (a pass, a missed speed target, a missing device).
rerun_kind() {
    case "$1" in
        0 | 2 | 3) echo none ;;
        124 | 137) echo longer ;;
        *) echo blocking ;;
    esac
}

# Seconds the sections after $1 are budgeted in all.
budgets_after() {
    local after=0 sum=0 entry
    for entry in "${SECTIONS[@]}"; do
        if [ "$after" = 1 ]; then sum=$((sum + $(budget_of "${entry%%:*}"))); fi
        if [ "${entry%%:*}" = "$1" ]; then after=1; fi
    done
    echo "$sum"
}

# One run of section $1 (budget $2 s) before the deadline $3 (ms): the first (`first` in $4) or a
# rerun (`blocking`: blocking launches; `longer`: the budget given; either with its own log and
# output folder): prints its line and sets A_ST (its status, or "not run: no time" when less than
# MIN_START seconds are left), and A_RC / A_TIME (empty when it did not run).
attempt() {
    local name="$1" budget="$2" deadline="$3" kind="$4" left limit suffix="" label="" blocking=0
    A_RC="" A_TIME=""
    left=$(((deadline - $(now_ms)) / 1000))
    if [ "$left" -lt "$MIN_START" ]; then
        A_ST="not run: no time"
        return
    fi
    limit=$((budget < left ? budget : left))
    case "$kind" in
        blocking)
            suffix=".rerun" blocking=1 label="rerun, CUDA_LAUNCH_BLOCKING=1: "
            if sanitized "$name"; then label="rerun, compute-sanitizer memcheck: "; fi
            ;;
        longer) suffix=".rerun" label="rerun, a longer budget: " ;;
    esac
    printf '  %-8s (≤ %3d s) %s' "$name" "$limit" "$label"
    run_section "$name" "$limit" "$blocking" "$OUT_DIR/$name$suffix.log" "$OUT_DIR/$name$suffix"
    A_ST="$(status_of "$RC")" A_RC="$RC" A_TIME="$(fmt_s "$TOOK_MS")"
    printf '%s in %s s\n' "$A_ST" "$A_TIME"
}

# Whether a blocking rerun of section $1 runs under compute-sanitizer: the binary's sections, where
# the image has one (the PEFT bench never).
sanitized() { [ -n "$SANITIZER" ] && [ "$1" != peft ]; }

# The budget of section $1 (DEVICE_CHECK_BUDGETS overrides).
budget_of() {
    local name="$1" entry
    for entry in "${SECTIONS[@]}"; do
        if [ "${entry%%:*}" = "$name" ]; then
            local b="${entry#*:}" o
            for o in ${DEVICE_CHECK_BUDGETS//,/ }; do
                if [ "${o%%=*}" = "$name" ]; then b="${o#*=}"; fi
            done
            echo "$b"
            return
        fi
    done
}

# Runs section $1 under a timeout of $2 seconds (CUDA_LAUNCH_BLOCKING=1 when $3 is 1, and then the
# binary under compute-sanitizer's memcheck where the image has it), its output in $4, the
# binary's report at prefix $5. Sets RC and TOOK_MS.
run_section() {
    local name="$1" limit="$2" blocking="$3" log="$4" prefix="$5" start cmd=()
    if [ "$name" = peft ]; then
        cmd=(python3 "$DIR/bench_peft_cuda.py" --workdir "$WORK" --json "$prefix.json")
    elif [ "$name" = replay ]; then
        cmd=("$REPLAY" --fatbins "$DIR/replay/fatbins" --corpus "$DIR/replay/corpus" --report "$prefix")
    else
        cmd=("$BIN" --fixtures "$DIR/fixtures/peft-tiny" --only "$name" --report "$prefix")
        if [ "$name" != none ]; then cmd+=("${EXTRA[@]}"); fi
        if [ "$name" = engine ]; then
            # The PEFT bench's figures: its rerun's when it had one.
            local peft
            for peft in "$OUT_DIR/peft.rerun.json" "$OUT_DIR/peft.json"; do
                if [ -s "$peft" ]; then
                    cmd+=(--peft-workdir "$WORK" --peft-json "$peft")
                    break
                fi
            done
        fi
    fi
    if [ "$blocking" = 1 ] && sanitized "$name"; then
        cmd=("$SANITIZER" --tool memcheck --print-limit 20 --error-exitcode 1 "${cmd[@]}")
    fi
    # The stub is given the command it stands in for, after the section and the prefix.
    if [ -n "$STUB" ]; then cmd=("$STUB" "$name" "$prefix" "${cmd[@]}"); fi
    rm -f "$prefix.json" "$prefix.key"
    start="$(now_ms)"
    RC=0
    # timeout runs the command in its own process group and signals all of it; SIGKILL 10 s
    # after SIGTERM if it does not go.
    CUDA_LAUNCH_BLOCKING="$blocking" timeout -k 10 "$limit" "${cmd[@]}" >"$log" 2>&1 || RC=$?
    TOOK_MS=$(($(now_ms) - start))
    if [ "$name" = peft ] && [ -z "$STUB" ] && [ "$RC" = 0 ] && [ -s "$prefix.json" ]; then
        python3 - "$prefix.json" >"$prefix.key" 2>/dev/null <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))["results"]
for d, v in r.items():
    print(f"{d}: base {v['base']['new_tokens_per_s']:.0f}, 8-adapter mix {v['mixed_8']['new_tokens_per_s']:.0f} new tok/s")
PY
    fi
}

preflight() {
    local pre="$OUT_DIR/preflight.txt"
    : >"$pre"
    echo "== preflight"
    local smi="not found"
    if command -v nvidia-smi >/dev/null; then
        smi="$(timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.max.sm \
            --format=csv,noheader 2>&1 || timeout 20 nvidia-smi -L 2>&1 || true)"
        smi="${smi:-no output}"
    fi
    PF_SMI="$smi"
    printf '  %-20s %s\n' "nvidia-smi" "$smi" | tee -a "$pre"
    local driver_version=""
    if [ -r /proc/driver/nvidia/version ]; then
        driver_version="$(sed -n '1s/.*Kernel Module *\([0-9.]*\).*/\1/p' /proc/driver/nvidia/version)"
    fi
    driver_version="${driver_version:-not loaded}"
    PF_BUILD="no build-info.txt"
    if [ -f "$DIR/build-info.txt" ]; then PF_BUILD="$(paste -sd ';' "$DIR/build-info.txt")"; fi
    printf '  %-20s %s\n' "binary" "$PF_BUILD" | tee -a "$pre"
    # compute-sanitizer, for the rerun of a section that failed: memcheck names the kernel and
    # the bad address where CUDA_LAUNCH_BLOCKING=1 only names the launch.
    SANITIZER="${DEVICE_CHECK_SANITIZER:-}"
    if [ "$SANITIZER" = none ]; then
        SANITIZER=""
    elif [ -z "$SANITIZER" ]; then
        local c
        for c in "$(command -v compute-sanitizer 2>/dev/null || true)" "${CUDA_HOME:-/nonexistent}/bin/compute-sanitizer" \
            /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer; do
            if [ -n "$c" ] && [ -x "$c" ]; then SANITIZER="$c" && break; fi
        done
    fi
    printf '  %-20s %s\n' "compute-sanitizer" "${SANITIZER:-not found (a failed section is rerun with CUDA_LAUNCH_BLOCKING=1 alone)}" | tee -a "$pre"

    # Every library candle's CUDA build may want, whether this binary links it (readelf's
    # NEEDED: it cannot start without those, nor without libcublasLt, which libcublas loads)
    # or not (the linker dropped what nothing calls).
    local linked="" libs="libcuda.so.1 libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13"
    if [ -z "$STUB" ] && [ -f "$BIN" ] && command -v readelf >/dev/null; then
        linked=" $(readelf -d "$BIN" | sed -n 's/.*Shared library: \[\(lib[^]]*\)\]/\1/p' | paste -sd ' ') "
    fi
    local dirs path="" lib d found role
    dirs="$(lib_dirs | awk '!seen[$0]++')"
    PF_DIRS="$dirs"
    PF_LIBS=()
    PF_MISSING=()
    DRIVER=0
    for lib in $libs; do
        found=""
        for d in $dirs; do
            if [ -e "$d/$lib" ]; then found="$d"; break; fi
        done
        role=""
        if [ -n "$linked" ]; then
            case "$linked" in
                *" $lib "*) role="linked" ;;
                *) if [ "$lib" = libcublasLt.so.13 ]; then role="loaded by libcublas"; else role="not linked by this binary"; fi ;;
            esac
        fi
        PF_LIBS+=("$lib=$found")
        if [ -z "$found" ]; then
            printf '  %-20s NOT FOUND%s\n' "$lib" "${role:+ ($role)}" | tee -a "$pre"
            PF_MISSING+=("$lib")
        else
            if [ "$lib" = libcuda.so.1 ]; then
                DRIVER=1
                role="${role:+$role, }kernel module $driver_version"
            fi
            printf '  %-20s %s%s\n' "$lib" "$found" "${role:+ ($role)}" | tee -a "$pre"
            case ":$path:" in *":$found:"*) ;; *) path="${path:+$path:}$found" ;; esac
        fi
    done
    local count
    count="$(printf '%s\n' "$dirs" | awk 'NF' | wc -l)"
    if [ "${#PF_MISSING[@]}" -gt 0 ]; then
        echo "  looked in $count directories: $(printf '%s\n' "$dirs" | awk 'NF' | paste -sd ' ')" | tee -a "$pre"
    else
        echo "  (looked in $count directories; listed in preflight.txt)"
        printf '%s\n' "$dirs" | sed 's/^/  searched: /' >>"$pre"
    fi
    export LD_LIBRARY_PATH="$path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    # The loader and the driver asked themselves, whatever the folders above found: the loader
    # opens libcuda.so.1 by its own rules (its cache, LD_LIBRARY_PATH, the system folders), and
    # `cuInit` says whether the driver sees a device (0) or not (100: no device). A driver the
    # loader opens counts, even in a folder no list above names.
    PF_LOADER="not asked (stub run)"
    if [ -z "$STUB" ]; then
        PF_LOADER="$(python3 - <<'PY' 2>&1 || echo "not asked: python3 failed"
import ctypes
try:
    lib = ctypes.CDLL("libcuda.so.1")
except OSError as e:
    print(f"cannot load libcuda.so.1: {e}")
else:
    print(f"loaded libcuda.so.1, cuInit(0) = {lib.cuInit(0)}")
PY
)"
        case "$PF_LOADER" in loaded*) DRIVER=1 ;; esac
    fi
    printf '  %-20s %s\n' "loader, driver" "$PF_LOADER" | tee -a "$pre"
    # The dynamic loader's own view, with the directories above on its path.
    PF_LDD=""
    if [ -z "$STUB" ] && [ -f "$BIN" ] && command -v ldd >/dev/null; then
        PF_LDD="$(ldd "$BIN" 2>&1 | awk '/not found/ { print $1 }' | paste -sd ' ' || true)"
        if [ -n "$PF_LDD" ]; then
            echo "  ldd: not found: $PF_LDD" | tee -a "$pre"
        fi
    fi
}

plan() {
    local entry line="" sum=0 b
    for entry in "${SECTIONS[@]}"; do
        b="$(budget_of "${entry%%:*}")"
        line="$line ${entry%%:*} ${b}s,"
        sum=$((sum + b))
    done
    echo "== sections, each in its own process (budget):${line%,} = ${sum} s of ${TOTAL} s"
}

# Sets REPLAY to the device replay that starts here: the one built with the binary, else one
# built now from its source with the image's compiler (a loader that cannot start the first:
# another glibc), else empty (its section is then not run, and says why).
replay_ready() {
    REPLAY="$DIR/replay/replay"
    if [ -n "$STUB" ]; then return; fi
    local rc=0
    "$REPLAY" >/dev/null 2>&1 || rc=$?
    # Without arguments it prints its usage and exits 4: it started.
    if [ "$rc" = 4 ]; then return; fi
    echo "  the replay built with the binary cannot start here (exit $rc): building it from its source"
    REPLAY="$OUT_DIR/replay"
    local cxx
    for cxx in "${CXX:-}" c++ g++ clang++; do
        if [ -n "$cxx" ] && command -v "$cxx" >/dev/null &&
            replay_compile "$cxx" "$DIR/replay/src/emulate/replay.cpp" "$REPLAY" >"$OUT_DIR/replay-build.log" 2>&1; then
            echo "  built with $cxx"
            return
        fi
    done
    echo "  no compiler here could build it (replay-build.log): the replay section is not run"
    REPLAY=""
}

# The binary and the replay's fatbins, unpacked once.
unpack() {
    if [ ! -x "$BIN" ] && [ -f "$BIN.xz" ]; then
        unxz_to "$BIN.xz" "$BIN"
        chmod +x "$BIN"
    fi
    # The replay's fatbins, compressed like the binary (ours: some 19 MB raw).
    local f
    for f in "$DIR"/replay/fatbins/*.fatbin.xz; do
        if [ -f "$f" ] && [ ! -f "${f%.xz}" ]; then unxz_to "$f" "${f%.xz}"; fi
    done
}

# Decompresses $1 into $2 (xz, else Python's lzma), whole or not at all.
unxz_to() {
    local tmp="$2.tmp.$$"
    if command -v xz >/dev/null; then
        xz -dc "$1" >"$tmp"
    else
        python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$tmp"
    fi
    mv "$tmp" "$2"
}

# $OUT_DIR/device-check.json: the preflight, the probe and every section that ran, each with its
# report (the binary's PREFIX.json) and its rerun's.
write_json() {
    local exit_code="$1" sep="" kv entry name d
    {
        printf '{\n  "exit": %s,\n  "total_budget_s": %s,\n  "elapsed_s": %s,\n' \
            "$exit_code" "$TOTAL" "$(fmt_s $(($(now_ms) - T0)))"
        printf '  "preflight": {\n    "nvidia_smi": %s,\n    "binary": %s,\n    "compute_sanitizer": %s,\n    "libraries": {' \
            "$(json_str "$PF_SMI")" "$(json_str "$PF_BUILD")" "$(if [ -n "$SANITIZER" ]; then json_str "$SANITIZER"; else echo null; fi)"
        for kv in "${PF_LIBS[@]}"; do
            if [ -n "${kv#*=}" ]; then d="$(json_str "${kv#*=}")"; else d=null; fi
            printf '%s%s: %s' "$sep" "$(json_str "${kv%%=*}")" "$d"
            sep=", "
        done
        printf '},\n    "searched": ['
        sep=""
        for d in $PF_DIRS; do
            printf '%s%s' "$sep" "$(json_str "$d")"
            sep=", "
        done
        printf '],\n    "ldd_not_found": %s,\n    "loader": %s\n  },\n' "$(json_str "$PF_LDD")" "$(json_str "${PF_LOADER:-}")"
        printf '  "probe": {"rc": %s, "log": "probe.log"},\n  "sections": [' "${PROBE_RC:-null}"
        sep=""
        for entry in "${SECTIONS[@]}"; do
            name="${entry%%:*}"
            if [ -z "${ST[$name]:-}" ]; then continue; fi
            printf '%s\n    {"name": %s, "budget_s": %s, "status": %s, "rc": %s, "time_s": %s, "log": %s, "report": %s,' \
                "$sep" "$(json_str "$name")" "$(budget_of "$name")" "$(json_str "${ST[$name]}")" \
                "${SRC[$name]:-null}" "${STIME[$name]:-null}" "$(json_str "$name.log")" "$(json_file "$OUT_DIR/$name.json")"
            if [ -n "${RST[$name]:-}" ]; then
                local env=null
                if [ "${RKIND[$name]}" = blocking ]; then
                    env='"CUDA_LAUNCH_BLOCKING=1"'
                    if sanitized "$name"; then env='"CUDA_LAUNCH_BLOCKING=1, compute-sanitizer --tool memcheck"'; fi
                fi
                printf '\n     "rerun": {"kind": %s, "env": %s, "budget_s": %s, "status": %s, "rc": %s, "time_s": %s, "log": %s, "report": %s}}' \
                    "$(json_str "${RKIND[$name]}")" "$env" "${RBUDGET[$name]}" \
                    "$(json_str "${RST[$name]}")" "${RRC[$name]:-null}" "${RTIME[$name]:-null}" \
                    "$(json_str "$name.rerun.log")" "$(json_file "$OUT_DIR/$name.rerun.json")"
            else
                printf ' "rerun": null}'
            fi
            sep=","
        done
        printf '\n  ]\n}\n'
    } >"$OUT_DIR/device-check.json"
}

# The end of a run, with exit status $1: device-check.json and summary.txt, and everything the run
# wrote (the preflight, the probe, each section's log, key and report) in one archive beside them,
# device-check.tar.gz: a device machine sends back a few files, and these three are the ones.
finish() {
    local code="$1" tmp
    write_json "$code"
    summary "$code" | tee "$OUT_DIR/summary.txt"
    tmp="$(mktemp)"
    if tar -czf "$tmp" -C "$OUT_DIR" --exclude=./device-check.tar.gz . && mv "$tmp" "$OUT_DIR/device-check.tar.gz"; then
        echo "== $OUT_DIR: summary.txt, device-check.json and device-check.tar.gz ($(($(stat -c %s "$OUT_DIR/device-check.tar.gz") / 1024)) KiB: every file of the run)"
    else
        rm -f "$tmp"
        echo "warning: the archive could not be written; the files are in $OUT_DIR" >&2
    fi
    exit "$code"
}

# The one-screen table: a row per section, its key figures (the binary's PREFIX.key, or the
# last lines of its log when it left none) on the rows below.
summary() {
    local exit_code="$1" entry name status time keys
    echo
    echo "== summary: $(fmt_s $(($(now_ms) - T0))) s of the ${TOTAL} s budget; exit $exit_code; logs and device-check.json in $OUT_DIR"
    printf '%-8s %-24s %-15s %s\n' section status "time / budget" "key figures (measured / floor at the device's bandwidth)"
    for entry in "${SECTIONS[@]}"; do
        name="${entry%%:*}"
        status="${ST[$name]:-not reached}"
        time="${STIME[$name]:--} / $(budget_of "$name") s"
        if [ -n "${RST[$name]:-}" ]; then
            status="$status; rerun ${RST[$name]}"
            time="${STIME[$name]:--}+${RTIME[$name]:--} / $(budget_of "$name")+${RBUDGET[$name]} s"
        fi
        keys=""
        if [ -n "${SRC[$name]:-}" ]; then
            if [ -s "$OUT_DIR/$name.key" ]; then keys="$(cat "$OUT_DIR/$name.key")"; else keys="$(last_lines "$OUT_DIR/$name.log" 2)"; fi
        fi
        if [ -n "${RRC[$name]:-}" ]; then
            if [ -s "$OUT_DIR/$name.rerun.key" ]; then
                keys="$keys"$'\n'"$(sed 's/^/rerun: /' "$OUT_DIR/$name.rerun.key")"
            else
                keys="$keys"$'\n'"$(last_lines "$OUT_DIR/$name.rerun.log" 2 | sed 's/^/rerun: /')"
            fi
        fi
        local first=1 line
        while IFS= read -r line || [ -n "$line" ]; do
            if [ "$first" = 1 ]; then
                printf '%-8s %-24s %-15s %s\n' "$name" "$status" "$time" "$line"
                first=0
            elif [ -n "$line" ]; then
                printf '%-8s %-24s %-15s %s\n' "" "" "" "$line"
            fi
        done <<<"$keys"
    done
}

run() {
    DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
    BIN="$DIR/multilora-device-check"
    OUT_DIR="${OUT:-$DIR/out}"
    WORK="${MULTILORA_PEFT_WORKDIR:-${TMPDIR:-/tmp}/multilora-peft-cuda}"
    STUB="${DEVICE_CHECK_STUB:-}"
    EXTRA=("$@")
    TOTAL="${DEVICE_CHECK_TOTAL:-$TOTAL_BUDGET}"
    DEVICE_CHECK_BUDGETS="${DEVICE_CHECK_BUDGETS:-}"
    T0="$(now_ms)"
    local deadline=$((T0 + TOTAL * 1000))
    # The driver compiles the PTX of candle's kernels for the GPU on first use (ours ship as
    # SASS); its cache (256 MiB by default) is made big enough to keep all of it, so that each
    # section's process after `jit` loads them compiled.
    export CUDA_CACHE_MAXSIZE="${CUDA_CACHE_MAXSIZE:-4294967296}"
    declare -gA ST=() SRC=() STIME=() RST=() RRC=() RTIME=() RKIND=() RBUDGET=()
    mkdir -p "$OUT_DIR"
    # A previous run's files in the same folder would be read as this run's (the engine takes
    # the PEFT bench's JSON from there): removed, by name, nothing else.
    local entry name
    for name in probe "${SECTIONS[@]%%:*}"; do
        rm -f "$OUT_DIR/$name".{json,key,log} "$OUT_DIR/$name.rerun".{json,key,log}
    done
    rm -f "$OUT_DIR/device-check.json" "$OUT_DIR/preflight.txt" "$OUT_DIR/summary.txt" "$OUT_DIR/device-check.tar.gz"
    if [ -z "$STUB" ]; then unpack; fi
    preflight
    plan
    if [ -z "$STUB" ]; then
        if [ "$DRIVER" = 0 ]; then
            echo "error: no CUDA device here: no NVIDIA driver (libcuda.so.1) in the $(printf '%s\n' "$PF_DIRS" | awk 'NF' | wc -l) folders searched (preflight.txt), and the loader cannot open one" >&2
            finish 2
        fi
        if [ ! -x "$BIN" ]; then
            echo "error: $BIN is missing: run scripts/device-check.sh build first" >&2
            finish 1
        fi
    fi

    replay_ready
    echo "== device probe (the binary opens the device and stops)"
    BINARY_OK=1
    run_section none 60 0 "$OUT_DIR/probe.log" "$OUT_DIR/probe"
    PROBE_RC="$RC"
    case "$RC" in
        0)
            local opened
            opened="$(sed -n 's/^\[ *\] device: //p' "$OUT_DIR/probe.log")"
            echo "  the device opened${opened:+: $opened}"
            ;;
        2)
            sed 's/^/  /' "$OUT_DIR/probe.log" >&2
            echo "error: no CUDA device: no section can run" >&2
            finish 2
            ;;
        *)
            BINARY_OK=0
            echo "  the binary cannot start (exit $RC): its sections are not run; the PEFT bench still is"
            sed -n '1,3s/^/  /p' "$OUT_DIR/probe.log"
            ;;
    esac

    echo "== sections (a failed one is rerun at once with CUDA_LAUNCH_BLOCKING=1${SANITIZER:+ under compute-sanitizer memcheck}, one that timed out with a longer budget)"
    local budget kind spare
    for entry in "${SECTIONS[@]}"; do
        name="${entry%%:*}"
        budget="$(budget_of "$name")"
        if [ "$name" = peft ] && [ "${MULTILORA_SKIP_PEFT:-0}" = 1 ]; then
            ST[$name]="skipped"
        elif [ "$name" = replay ] && [ -z "$REPLAY" ]; then
            ST[$name]="not run: no replay"
        elif [ "$name" != peft ] && [ "$name" != replay ] && [ "$BINARY_OK" = 0 ]; then
            ST[$name]="not run: no binary"
        else
            attempt "$name" "$budget" "$deadline" first
            ST[$name]="$A_ST"
            if [ -n "$A_RC" ]; then
                SRC[$name]="$A_RC"
                STIME[$name]="$A_TIME"
            fi
            kind="$(rerun_kind "${A_RC:-0}")"
            if [ "$kind" = longer ]; then
                # Twice the budget, out of what the sections after it leave: none when that is
                # no longer than the first.
                spare=$(((deadline - $(now_ms)) / 1000 - $(budgets_after "$name")))
                budget=$((2 * budget < spare ? 2 * budget : spare))
                if [ "$budget" -le "$(budget_of "$name")" ]; then kind=none; fi
            fi
            if [ "$kind" != none ]; then
                RKIND[$name]="$kind" RBUDGET[$name]="$budget"
                attempt "$name" "$budget" "$deadline" "$kind"
                RST[$name]="$A_ST"
                if [ -n "$A_RC" ]; then
                    RRC[$name]="$A_RC"
                    RTIME[$name]="$A_TIME"
                fi
            fi
        fi
    done

    # The run's status: a failure anywhere (a rerun that passed included: the first run still
    # failed), else a missed speed target, else a pass.
    local exit_code=0
    for entry in "${SECTIONS[@]}"; do
        name="${entry%%:*}"
        case "${ST[$name]}" in
            pass | skipped) ;;
            slow) if [ "$exit_code" = 0 ]; then exit_code=3; fi ;;
            *) exit_code=1 ;;
        esac
    done
    finish "$exit_code"
}

case "${1:-}" in
    build) shift; build "$@" ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 build [DIR] | $0 run [flags for every section of the binary, e.g. --quick]" >&2; exit 2 ;;
esac
