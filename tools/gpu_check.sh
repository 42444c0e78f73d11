#!/usr/bin/env bash
# The prepared GPU check, one call on a machine with a CUDA device:
#   1. build libtieredkv_kernels.so (cmake + nvcc, or nvcc alone, or a prebuilt
#      build/plugins/libtieredkv_kernels.so carried from elsewhere);
#   2. run every op's CUDA implementation against its PyTorch reference on fresh random inputs
#      of awkward sizes: the `cuda` tests of tests/plugins (pytest -m cuda);
#   3. time the kernels at real model shapes: tools/bench_kernels.py.
# Everything goes under $OUT (default ./gpu_out): build.log, nvidia-smi.txt, tests.log,
# tests.xml (JUnit), bench_kernels.{json,md}, gpu_check.md (the summary).
#
# The checkout need not be installed: tieredkv is imported from this checkout through a tree of
# symlinks (build/pysite). pytest must be importable; where the machine has none (no network),
# carry one: `pip install --target build/pydeps pytest` here, then pass build/pydeps along
# (it is put on PYTHONPATH when present). Extra arguments go to bench_kernels.py.
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
    start=$(date +%s)
    if command -v cmake >/dev/null 2>&1; then
      GEN=()
      command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
      if cmake -S "$ROOT/plugins/csrc" -B "$DEVICE_BUILD" "${GEN[@]}" && cmake --build "$DEVICE_BUILD" -j "$(nproc)"; then
        LIB="$DEVICE_BUILD/libtieredkv_kernels.so"
      else
        echo "cmake build FAILED"
      fi
    else
      mkdir -p "$DEVICE_BUILD"
      # -ffp-contract=off as in CMakeLists.txt: the host codec must not fuse a*b+c
      if nvcc -std=c++17 -O3 -shared -Xcompiler -fPIC,-fvisibility=hidden,-ffp-contract=off \
          -gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_90,code=compute_90 \
          -I"$ROOT/plugins/csrc" "$ROOT/plugins/csrc/capi.cu" -o "$DEVICE_BUILD/libtieredkv_kernels.so"; then
        LIB="$DEVICE_BUILD/libtieredkv_kernels.so"
      else
        echo "nvcc build FAILED"
      fi
    fi
    [ -n "$LIB" ] && echo "built in $(( $(date +%s) - start )) s: $LIB"
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
export TIEREDKV_KERNELS="$LIB"

# tieredkv from this checkout, installed or not: build/pysite/tieredkv mirrors pyproject's package-dir
SITE="$ROOT/build/pysite"
rm -rf "$SITE" && mkdir -p "$SITE/tieredkv"
for f in "$ROOT"/tieredkv/*.py; do ln -s "$f" "$SITE/tieredkv/"; done
for pkg in models runtime plugins builder; do ln -s "$ROOT/$pkg" "$SITE/tieredkv/$pkg"; done
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
[ -d "$ROOT/build/pydeps" ] && export PYTHONPATH="$PYTHONPATH:$ROOT/build/pydeps"

# run from $OUT: the checkout's root would shadow build/pysite with its bare tieredkv/ directory
cd "$OUT"
tests_rc=2
if "$PYTHON" -c "import pytest" >/dev/null 2>&1; then
  "$PYTHON" -m pytest -c "$ROOT/pyproject.toml" --rootdir "$ROOT" -m cuda "$ROOT/tests/plugins" -q -rs \
    -p no:cacheprovider --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log"
  tests_rc=${PIPESTATUS[0]}
else
  echo "gpu_check.sh: pytest is not importable (carry build/pydeps, see the header)" | tee "$OUT/tests.log"
fi
"$PYTHON" "$ROOT/tools/bench_kernels.py" --lib "$LIB" --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}

{
  echo "# tieredkv GPU check"
  echo
  echo "- $(date -u +%Y-%m-%d), $(head -n 1 "$OUT/nvidia-smi.txt" 2>/dev/null)"
  echo "- device: $("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name())' 2>/dev/null || echo none)"
  echo "- library: \`$LIB\`"
  echo "- correctness (\`pytest -m cuda tests/plugins\`, exit $tests_rc): $(tail -n 1 "$OUT/tests.log")"
  echo "- timing (\`tools/bench_kernels.py\`, exit $bench_rc): bench_kernels.md"
  echo
  [ -f "$OUT/bench_kernels.md" ] && sed -n '/^| op/,$p' "$OUT/bench_kernels.md"
} >"$OUT/gpu_check.md"
cat "$OUT/gpu_check.md"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
