#!/usr/bin/env bash
# GPU check: install a CUDA build of llama-cpp-python (when given one), then measure the pass cost
# t(n)/t(1), n = 1..64, on random-weight Qwen2.5-7B and Qwen2.5-32B shaped Q4_K_M models and run the
# embedded pair in ar / lossless / prove. Writes JSON. Made for a machine with one NVIDIA GPU, no
# internet and about 8 minutes; `--cpu` runs small shapes on the CPU (about a minute; the test suite does).
#
#   scripts/gpu_check.sh [--out FILE] [--wheel LLAMA_CPP_WHEEL] [--wheelhouse DIR] [--src SDIST_OR_DIR]
#                        [--total SECONDS] [--cpu] [-- more options for scripts/gpu_check.py]
#
#   --wheel FILE      install this llama-cpp-python wheel (a CUDA build made beforehand), no network
#   --wheelhouse DIR  install every wheel in DIR first (e.g. gguf, diskcache, a CUDA llama-cpp-python)
#   --src PATH        build llama-cpp-python from this sdist (or unpacked folder) with CUDA for the GPU's
#                     architecture (needs nvcc, cmake, ninja, scikit-build-core; several minutes)
#   --total SECONDS   wall-clock budget for the whole script (default 480); stages that would not fit are skipped
#   --out FILE        JSON result (default gpu_check.json)
# Environment: PYTHON (default python3), CUDA_ARCH (e.g. 90; default from nvidia-smi's compute_cap),
#              EXTRA_CMAKE_ARGS (added to the CUDA build's CMAKE_ARGS; the multimodal library is left out).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_JSON=gpu_check.json
WHEEL= WHEELHOUSE= SRC= CPU= TOTAL=480
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT_JSON=$2; shift 2 ;;
    --wheel) WHEEL=$2; shift 2 ;;
    --wheelhouse) WHEELHOUSE=$2; shift 2 ;;
    --src) SRC=$2; shift 2 ;;
    --total) TOTAL=$2; shift 2 ;;
    --cpu) CPU=1; shift ;;
    --) shift; EXTRA+=("$@"); break ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
T0=$(date +%s)
log() { echo "[gpu_check.sh $(( $(date +%s) - T0 ))s] $*" >&2; }
METHOD=existing
PIP=("$PY" -m pip install -q --no-index --no-deps --no-cache-dir)

if [ -n "$WHEELHOUSE" ]; then
  log "installing the wheels in $WHEELHOUSE"
  "${PIP[@]}" --force-reinstall "$WHEELHOUSE"/*.whl || { log "wheelhouse install failed"; exit 1; }
  METHOD=wheelhouse
fi
if [ -n "$WHEEL" ]; then
  log "installing $WHEEL"
  "${PIP[@]}" --force-reinstall "$WHEEL" || { log "wheel install failed"; exit 1; }
  METHOD=wheel
elif [ -n "$SRC" ]; then
  ARCH=${CUDA_ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')}
  ARCH=${ARCH:-90}
  log "building llama-cpp-python from $SRC with CUDA for sm_$ARCH (GGML_NATIVE=OFF)"
  CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$ARCH -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF ${EXTRA_CMAKE_ARGS:-}" \
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "${PIP[@]}" --no-build-isolation --force-reinstall "$SRC" || { log "CUDA build failed"; exit 1; }
  METHOD="build sm_$ARCH"
fi
INSTALL_S=$(( $(date +%s) - T0 ))

if ! "$PY" -c "import llama_cpp, gguf" 2>/dev/null; then
  log "llama_cpp or gguf is not importable with $PY; give --wheel/--wheelhouse (see README: the GPU route)"
  exit 1
fi
OFFLOAD=$("$PY" -c "import llama_cpp as l; l.llama_backend_init(); print(int(l.llama_supports_gpu_offload()))" 2>/dev/null)
log "install: $METHOD in ${INSTALL_S}s; GPU offload: $OFFLOAD"
if [ -z "$CPU" ] && [ "$OFFLOAD" != 1 ]; then
  log "warning: this llama.cpp build has no GPU backend; the numbers will be CPU numbers"
fi

LEFT=$(( TOTAL - $(date +%s) + T0 - 20 ))
[ "$LEFT" -lt 30 ] && LEFT=30
ARGS=(--out "$OUT_JSON" --budget "$LEFT"
      --install "{\"method\": \"$METHOD\", \"seconds\": $INSTALL_S, \"gpu_offload\": ${OFFLOAD:-0}}")
[ -n "$CPU" ] && ARGS+=(--cpu)
PYTHONUNBUFFERED=1 "$PY" scripts/gpu_check.py "${ARGS[@]}" "${EXTRA[@]}"
rc=$?
log "done (rc $rc): $OUT_JSON"
exit $rc
