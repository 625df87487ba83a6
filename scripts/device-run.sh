#!/usr/bin/env bash
# The one command a lent GPU machine runs, from the repository root, with the device check laid
# out by `scripts/device-check.sh build` carried along (`carry: ["target/device-check"]`):
#
#   bash scripts/device-run.sh [FLAGS for every section, e.g. --quick]
#
# Tracked, so that what runs there is reviewed here (the machine's command line is short). The
# run's files go to $OUT (what the machine sends back; else target/device-check/out): summary.txt,
# device-check.json and device-check.tar.gz, every other file of the run inside the archive.
# Exit status as device-check.sh's: 0 passed, 1 a failure, 2 no CUDA device, 3 speed targets
# missed. CI dry-runs this very script (no GPU: it stops at "no CUDA device" with exit 2).
set -uo pipefail
dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target/device-check"
if [ ! -f "$dir/device-check.sh" ]; then
    echo "error: $dir/device-check.sh is missing: run scripts/device-check.sh build first, and carry target/device-check" >&2
    exit 1
fi
OUT="${OUT:-$dir/out}" exec bash "$dir/device-check.sh" run "$@"
