#!/usr/bin/env bash
# One prepared GPU check for a machine with a CUDA device: build (or reuse) libtieredkv_kernels.so,
# record nvidia-smi, run tools/gpu_check.py. Everything goes under $OUT (default ./gpu_out):
#   build.log, nvidia-smi.txt, gpu_check.log, gpu_check.json, gpu_check.md
# Library: built with cmake when nvcc and cmake are here, with nvcc alone when only nvcc is,
# else the prebuilt build/plugins/libtieredkv_kernels.so (build it elsewhere and carry it).
# Extra arguments go to gpu_check.py (e.g. --no-timing, --repeats 50, --seed 1).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/gpu_out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export OUT
if [ -z "${PYTHON:-}" ]; then  # the first python that has torch
  for candidate in python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch" >/dev/null 2>&1; then
      PYTHON="$(command -v "$candidate")"
      break
    fi
  done
fi
PYTHON="${PYTHON:-python3}"
PREBUILT="$ROOT/build/plugins/libtieredkv_kernels.so"
DEVICE_BUILD="$ROOT/build/plugins-device"
LIB=""

{
  echo "== gpu_check.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
  if command -v nvcc >/dev/null 2>&1; then
    nvcc --version | tail -n 2
    if command -v cmake >/dev/null 2>&1; then
      GEN=()
      command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
      start=$(date +%s)
      if cmake -S "$ROOT/plugins/csrc" -B "$DEVICE_BUILD" "${GEN[@]}" && cmake --build "$DEVICE_BUILD" -j "$(nproc)"; then
        LIB="$DEVICE_BUILD/libtieredkv_kernels.so"
        echo "built with cmake in $(( $(date +%s) - start )) s: $LIB"
      else
        echo "cmake build FAILED"
      fi
    else
      mkdir -p "$DEVICE_BUILD"
      # -ffp-contract=off as in CMakeLists.txt: the host codec (the check compares against it) must not fuse a*b+c
      if nvcc -std=c++17 -O3 -shared -Xcompiler -fPIC,-fvisibility=hidden,-ffp-contract=off \
          -gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_90,code=compute_90 \
          -I"$ROOT/plugins/csrc" "$ROOT/plugins/csrc/capi.cu" -o "$DEVICE_BUILD/libtieredkv_kernels.so"; then
        LIB="$DEVICE_BUILD/libtieredkv_kernels.so"
        echo "built with nvcc (no cmake): $LIB"
      else
        echo "nvcc build FAILED"
      fi
    fi
  else
    echo "no nvcc here"
  fi
  if [ -z "$LIB" ] && [ -f "$PREBUILT" ]; then
    LIB="$PREBUILT"
    echo "using the prebuilt $LIB"
  fi
  echo "library: ${LIB:-none}"
} >"$OUT/build.log" 2>&1
cat "$OUT/build.log"

nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed (see nvidia-smi.txt)"
head -n 15 "$OUT/nvidia-smi.txt"

if [ -z "$LIB" ]; then
  echo "gpu_check.sh: no libtieredkv_kernels.so (no nvcc here and no $PREBUILT)" | tee -a "$OUT/build.log"
  exit 2
fi

"$PYTHON" "$ROOT/tools/gpu_check.py" --lib "$LIB" --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
