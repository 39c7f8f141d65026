#!/usr/bin/env bash
# Make a smaller copy of the llama-cpp-python sdist for machines without internet (the GPU check's --src):
# drops the git pack, llama.cpp's test vocabularies, docs, media and benchmarks (76 MB -> about 12 MB).
#   scripts/slim_llama_sdist.sh llama_cpp_python-0.3.36.tar.gz OUT_DIR   ->  OUT_DIR/llama_cpp_python-0.3.36-slim.tar.gz
# Get the sdist where PyPI is reachable: pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36
set -euo pipefail
case "${1:-}" in -h|--help|"") sed -n '2,5p' "$0"; [ -n "${1:-}" ]; exit ;; esac
SDIST=$(realpath "$1"); OUT=$(realpath -m "$2")
mkdir -p "$OUT"
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
tar xzf "$SDIST" -C "$TMP"
TOP=$(ls "$TMP"); V="$TMP/$TOP/vendor/llama.cpp"
rm -rf "$TMP/$TOP/.git" "$V/docs" "$V/media" "$V/benches"
find "$V/models" -name '*.gguf*' -delete
tar czf "$OUT/$TOP-slim.tar.gz" -C "$TMP" "$TOP"
ls -la "$OUT/$TOP-slim.tar.gz"
