#!/usr/bin/env bash
# llama.cpp as the peer of the GGUF benchmarks: built from the copy vendored in the
# `llama_cpp_python` source package on the package registry (the one way to get it here), CPU only,
# the native instruction set, OpenMP. A benchmark tool, not a CI step (~10 minutes on 2 cores).
#   benches/peers/llamacpp.sh build DIR     # DIR/lcpp-build/bin/{llama-server,llama-bench}
# compare.py (beside this file) then runs llama-bench, llama-server and `multilora serve` on the
# same file with the same requests, one after the other, and prints the ratios.
set -euo pipefail
cmd=${1:-} dir=${2:-}
case "$cmd" in
build)
  [ -n "$dir" ] || { echo "usage: llamacpp.sh build DIR" >&2; exit 2; }
  command -v cmake >/dev/null || { apt-get update -qq && apt-get install -y -qq cmake; }
  mkdir -p "$dir" && cd "$dir"
  version=0.3.36
  [ -f "llama_cpp_python-$version.tar.gz" ] \
    || python3 -m pip download -q --no-deps --no-binary llama_cpp_python -d . "llama_cpp_python==$version"
  [ -d "llama_cpp_python-$version" ] || tar xzf "llama_cpp_python-$version.tar.gz"
  # -march=native: a build made on another CPU may use instructions this one lacks (SIGILL), so
  # it is made again when the CPU's model and flags differ from the ones it was made on.
  cpu="$(grep -m1 -E '^(model name|flags)' /proc/cpuinfo; grep -m1 '^flags' /proc/cpuinfo)"
  if [ -d lcpp-build ] && [ "$(cat lcpp-build/.cpu 2>/dev/null)" != "$cpu" ]; then rm -rf lcpp-build; fi
  cmake -S "llama_cpp_python-$version/vendor/llama.cpp" -B lcpp-build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
  cmake --build lcpp-build --target llama-server llama-bench -j"$(nproc)" >/dev/null
  echo "$cpu" > lcpp-build/.cpu
  echo "$dir/lcpp-build/bin" ;;
*) echo "usage: llamacpp.sh build DIR" >&2; exit 2 ;;
esac
