#!/usr/bin/env bash
# The llama.cpp peers, built for the machine they run on: llama-server (its OpenAI-compatible server, parallel
# slots and continuous batching: the peer for throughput) from the llama.cpp sources inside the pinned
# llama-cpp-python sdist, and llama-cpp-python itself (the peer for single-stream latency). llama-quantize, from
# the same sources, makes the K-quant test fixture (tests/models/kquant_fixture.py).
#
# Both are built with the CPU's own instructions (GGML_NATIVE). The flags of the CPU they were built on are kept
# beside them; on a machine whose flags differ, both are rebuilt (a native build run on a CPU that lacks one of
# its instructions dies with SIGILL). Needs only the package registry: the sources come from PyPI's sdist.
#
#   bash bench/build_llama.sh .venv        # prints the llama-server path
set -euo pipefail
venv=${1:-.venv}
version=0.3.36
root="$venv/llama.cpp"
flags=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | sort | tr '\n' ' ' | md5sum | cut -d' ' -f1)
mkdir -p "$root"
if [ -x "$root/build/bin/llama-server" ] && [ -x "$root/build/bin/llama-quantize" ] &&
   [ "$(cat "$root/cpu-flags" 2>/dev/null)" = "$flags" ]; then
  echo "$root/build/bin/llama-server"
  exit 0
fi
echo "building llama-server $version for this CPU ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs))" >&2
rm -rf "$root/src" "$root/build" "$root/cpu-flags"
"$venv/bin/python" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$root/sdist"
mkdir -p "$root/src"
tar xzf "$root/sdist/llama_cpp_python-$version.tar.gz" -C "$root/src" --strip-components=1
cmake -S "$root/src/vendor/llama.cpp" -B "$root/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$root/build" --target llama-server llama-quantize -j "$(nproc)" >&2  # llama-quantize: test fixtures
# The Python binding from the same sources, native too; --no-cache-dir: a wheel cached on another CPU must not
# be reused here.
CMAKE_ARGS="-DGGML_NATIVE=ON" "$venv/bin/python" -m pip install -q --no-deps --no-cache-dir --force-reinstall \
  "$root/sdist/llama_cpp_python-$version.tar.gz" >&2
"$venv/bin/python" -m pip install -q "diskcache>=5.6.1" >&2  # its one dependency the venv lacks
echo "$flags" > "$root/cpu-flags"
echo "$root/build/bin/llama-server"
