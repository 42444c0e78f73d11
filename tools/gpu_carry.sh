#!/usr/bin/env bash
# Builds build/gpu-carry/, the one ignored folder a lent GPU machine gets beside the checkout (the
# device tool's `carry`; docs/gpu-check.md), from this machine:
#   trt-include/  the TensorRT headers (every Nv*.h of $TRT_INCLUDE_DIR and impl/, under 1 MiB):
#                 the GPU machine has no TensorRT, but with these its build stage compiles the
#                 plugin library and the harness that drives it (tests/plugins/test_trt_plugins.py)
#   lib/          libtieredkv_kernels.so, libtieredkv_trt_plugins.so, libtieredkv_trt_harness.so
#                 built here (CMake, sm_90 SASS + compute_90 PTX), used there only when it has no
#                 nvcc (the static CUDA runtime of this nvcc then needs a driver of its major version)
#   pydeps/       pytest and the runtime's small dependencies for CPython 3.12 on x86-64 Linux
#                 (pip --target, binary wheels, no dependencies resolved), on PYTHONPATH there
#                 when the machine lacks them
# Never commit it (build/ is ignored): it holds NVIDIA's headers and third-party wheels.
#
# usage: TRT_INCLUDE_DIR=/path/to/TensorRT/include tools/gpu_carry.sh [--no-lib] [--no-pydeps]
#   CUDA_ARCHS (default "90-real;90-virtual"), PYTHON (default python3), JOBS (default nproc)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CARRY="$ROOT/build/gpu-carry"
LIB=1
PYDEPS=1
for arg in "$@"; do
  case "$arg" in
    --no-lib) LIB=0 ;;
    --no-pydeps) PYDEPS=0 ;;
    *) echo "usage: TRT_INCLUDE_DIR=... $0 [--no-lib] [--no-pydeps]" >&2; exit 2 ;;
  esac
done
if [ -z "${TRT_INCLUDE_DIR:-}" ] || [ ! -f "$TRT_INCLUDE_DIR/NvInfer.h" ]; then
  echo "TRT_INCLUDE_DIR must name a TensorRT include directory (NvInfer.h), e.g. the include/ of" \
       "github.com/NVIDIA/TensorRT at the release the plugins are built against" >&2
  exit 2
fi
PYTHON="${PYTHON:-python3}"

rm -rf "$CARRY/trt-include"
mkdir -p "$CARRY/trt-include"
cp "$TRT_INCLUDE_DIR"/Nv*.h "$CARRY/trt-include/"
[ -d "$TRT_INCLUDE_DIR/impl" ] && cp -r "$TRT_INCLUDE_DIR/impl" "$CARRY/trt-include/"
echo "trt-include: $(sed -n 's/^#define TRT_\(MAJOR\|MINOR\|PATCH\)_ENTERPRISE \([0-9]*\)/\2/p' \
  "$CARRY/trt-include/NvInferVersion.h" | paste -sd.) headers, $(du -sh "$CARRY/trt-include" | cut -f1)"

if [ "$LIB" = 1 ]; then
  build="$ROOT/build/plugins-carry"
  gen=()
  command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  cmake -S "$ROOT/plugins/csrc" -B "$build" "${gen[@]}" -DTRT_INCLUDE_DIR="$CARRY/trt-include" \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90-real;90-virtual}" >/dev/null
  cmake --build "$build" -j "${JOBS:-$(nproc)}"
  rm -rf "$CARRY/lib"
  mkdir -p "$CARRY/lib"
  cp "$build"/libtieredkv_kernels.so "$build"/libtieredkv_trt_plugins.so "$build"/libtieredkv_trt_harness.so \
    "$CARRY/lib/"
  echo "lib: $(ls "$CARRY/lib" | paste -sd' '), $(du -sh "$CARRY/lib" | cut -f1) (nvcc $(nvcc --version |
    sed -n 's/.*release \([0-9.]*\).*/\1/p'))"
fi

if [ "$PYDEPS" = 1 ]; then
  rm -rf "$CARRY/pydeps"
  # what tools/gpu_check.sh imports beyond torch, numpy and onnx (there): pytest and its
  # dependencies, and the runtime modules' tokenizers, tqdm and gguf
  "$PYTHON" -m pip install --quiet --no-deps --target "$CARRY/pydeps" --python-version 3.12 --implementation cp \
    --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 pytest iniconfig pluggy packaging pygments tokenizers tqdm gguf
  rm -rf "$CARRY/pydeps/bin"
  find "$CARRY/pydeps" -name __pycache__ -prune -exec rm -rf {} +
  echo "pydeps: $(du -sh "$CARRY/pydeps" | cut -f1)"
fi
echo "build/gpu-carry: $(du -sh "$CARRY" | cut -f1) (the device tool carries at most 64 MiB)"
