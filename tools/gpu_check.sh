#!/usr/bin/env bash
# The prepared GPU check: one call on a machine with a CUDA device (an H200 in mind), well
# under 10 minutes. Stages, each with its own time limit, each run whatever the others did:
#   device   nvidia-smi: driver, the CUDA version the driver supports, GPU, compute capability;
#            fails clearly when the driver is older than what the nvcc build needs
#   build    libtieredkv_kernels.so: cmake (>= 3.24, as CMakeLists.txt requires) + nvcc; else nvcc
#            alone (the four .cu files compiled in parallel); else a prebuilt
#            build/plugins/libtieredkv_kernels.so carried from elsewhere
#   tests    every `cuda` test of tests/plugins: each kernel against its PyTorch reference on fresh
#            random inputs of awkward sizes (TieredAttention across split counts, fp16 / bf16 pools,
#            warm pages of every codec; ImportanceScore; KVAppend copy and in place; the codecs)
#   bench    tools/bench_kernels.py: the D2D copy bandwidth, every kernel against its reference at a
#            70B-like shape (32k context, fp16 pools, all pages and 25 % listed), then timings
#            (CUDA graphs) with GB/s as a share of the 4.8 TB/s HBM and of the measured copy
#   e2e      the end-to-end decode hook: `python tools/bench_gpu_decode.py --out $OUT` when that
#            file exists (skipped with a note otherwise)
# Everything goes under $OUT (default ./gpu_out): <stage>.log, nvidia-smi.txt, tests.xml (JUnit),
# bench_kernels.{json,md}, gpu_check.json (stages, exit codes, seconds) and gpu_check.md (the
# summary). Exit status 0 only when every stage that ran passed (a mismatch fails `tests` or
# `bench`); a skipped e2e stage does not fail the check.
#
# Time limits (seconds) from the environment: TKV_BUILD_S (150), TKV_TESTS_S (150), TKV_BENCH_S
# (150), TKV_E2E_S (105); with the device stage's 30 they stay under 10 minutes together. Extra
# arguments go to bench_kernels.py.
#
# The checkout need not be installed: tieredkv is imported from this checkout through a tree of
# symlinks (build/pysite). pytest and the runtime's small dependencies must be importable; where
# the machine has none (no network), carry them: `pip install --no-deps --target build/pydeps
# pytest iniconfig pluggy hypothesis sortedcontainers tokenizers tqdm safetensors` here, then pass
# build/pydeps along (it is put on PYTHONPATH when present). Details: docs/gpu-check.md.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/gpu_out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export OUT ROOT
if [ -z "${PYTHON:-}" ]; then  # the first python that has torch
  for candidate in python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch" >/dev/null 2>&1; then
      PYTHON="$(command -v "$candidate")"
      break
    fi
  done
fi
export PYTHON="${PYTHON:-python3}"
export PREBUILT="$ROOT/build/plugins/libtieredkv_kernels.so"
export DEVICE_BUILD="$ROOT/build/plugins-device"
STAGES="$OUT/stages.tsv"
: >"$STAGES"

# stage NAME LIMIT_S COMMAND...: runs COMMAND under a time limit, output to $OUT/NAME.log (and the
# terminal), and records "NAME<TAB>rc<TAB>seconds" (rc 124: out of time).
stage() {
  local name="$1" limit="$2"
  shift 2
  echo "== $name (limit ${limit}s)"
  local start rc
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" >>"$STAGES"
  echo "== $name: exit $rc"
  return 0
}

# ---- device: driver, CUDA version the driver supports, compute capability ----------------------
check_device() {
  : >"$OUT/device.env"
  command -v nvcc >/dev/null 2>&1 &&
    echo "NVCC=$(nvcc --version | sed -n 's/.*release \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p')" >>"$OUT/device.env"
  if ! nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1; then
    echo "FAIL: nvidia-smi failed (no NVIDIA driver?):"
    cat "$OUT/nvidia-smi.txt"
    return 1
  fi
  head -n 15 "$OUT/nvidia-smi.txt"
  local driver cc name driver_cuda
  IFS=',' read -r driver cc name < <(nvidia-smi --query-gpu=driver_version,compute_cap,name --format=csv,noheader | head -n 1)
  driver_cuda="$(sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' "$OUT/nvidia-smi.txt" | head -n 1)"
  echo "driver ${driver// /}, supports CUDA ${driver_cuda:-?}; GPU${name}; compute capability ${cc// /}"
  {
    echo "DRIVER=${driver// /}"
    echo "DRIVER_CUDA=${driver_cuda}"
    echo "COMPUTE_CAP=${cc// /}"
  } >>"$OUT/device.env"
  if command -v nvcc >/dev/null 2>&1; then
    local nvcc_version
    nvcc_version="$(sed -n 's/^NVCC=//p' "$OUT/device.env")"
    # the library links the CUDA runtime of this nvcc statically: the driver must support its major
    # version (minor version compatibility; sm_90 SASS needs no PTX JIT on an sm_90 GPU)
    if [ -n "$driver_cuda" ] && [ "${driver_cuda%%.*}" -lt "${nvcc_version%%.*}" ]; then
      echo "FAIL: nvcc $nvcc_version builds need a driver that supports CUDA ${nvcc_version%%.*}.x; this driver" \
           "(${driver// /}) supports CUDA $driver_cuda. The build stage will not use this nvcc (it falls back to a" \
           "prebuilt library, if one was carried); update the driver or build with an older toolkit."
      echo "NVCC_TOO_NEW=1" >>"$OUT/device.env"
      return 1
    fi
  else
    echo "no nvcc on PATH: the build stage needs a prebuilt $PREBUILT"
  fi
  local major="${cc%%.*}"
  if [ -n "$major" ] && [ "${major// /}" -lt 8 ] 2>/dev/null; then
    echo "FAIL: compute capability $cc: the kernels need sm_80 or newer (fp8 / bf16 conversions, 16-byte loads)"
    return 1
  fi
  return 0
}
export -f check_device

# ---- build -----------------------------------------------------------------------------------
build_library() {
  # shellcheck disable=SC1091
  [ -f "$OUT/device.env" ] && . "$OUT/device.env"
  local lib="" arch
  local cc="${COMPUTE_CAP:-9.0}"
  arch="${cc//./}"
  if [ "${NVCC_TOO_NEW:-0}" = 1 ]; then
    echo "not building: this driver cannot run what this nvcc builds (see device.log)"
  elif command -v nvcc >/dev/null 2>&1; then
    nvcc --version | tail -n 2
    local cmake_ok=0
    if command -v cmake >/dev/null 2>&1; then
      local v
      v="$(cmake --version | sed -n 's/cmake version \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')"
      set -- $v
      if [ "${1:-0}" -gt 3 ] || { [ "${1:-0}" -eq 3 ] && [ "${2:-0}" -ge 24 ]; }; then cmake_ok=1; fi
      [ "$cmake_ok" = 1 ] || echo "$(cmake --version | head -n 1) is older than 3.24: building with nvcc alone"
    fi
    if [ "$cmake_ok" = 1 ]; then
      local gen=()
      command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
      if cmake -S "$ROOT/plugins/csrc" -B "$DEVICE_BUILD" "${gen[@]}" \
           -DCMAKE_CUDA_ARCHITECTURES="${arch}-real;${arch}-virtual" &&
         cmake --build "$DEVICE_BUILD" -j "$(nproc)"; then
        lib="$DEVICE_BUILD/libtieredkv_kernels.so"
      else
        echo "cmake build FAILED"
      fi
    else
      mkdir -p "$DEVICE_BUILD/nvcc"
      # the flags of CMakeLists.txt: -ffp-contract=off (the host codec must not fuse a*b+c), hidden
      # symbols but the C ABI, the static CUDA runtime (nvcc's default)
      local flags=(-std=c++17 -O3 -Xcompiler -fPIC,-fvisibility=hidden,-ffp-contract=off
                   "-gencode=arch=compute_${arch},code=sm_${arch}" "-gencode=arch=compute_${arch},code=compute_${arch}"
                   -I"$ROOT/plugins/csrc")
      local pids=() objs=() ok=1 src
      for src in "$ROOT"/plugins/csrc/*.cu; do
        local obj
        obj="$DEVICE_BUILD/nvcc/$(basename "$src" .cu).o"
        objs+=("$obj")
        nvcc "${flags[@]}" -c "$src" -o "$obj" &
        pids+=($!)
      done
      for pid in "${pids[@]}"; do wait "$pid" || ok=0; done
      if [ "$ok" = 1 ] && nvcc -shared "${objs[@]}" -o "$DEVICE_BUILD/libtieredkv_kernels.so" -Xlinker -z -Xlinker defs; then
        lib="$DEVICE_BUILD/libtieredkv_kernels.so"
      else
        echo "nvcc build FAILED"
      fi
    fi
  else
    echo "no nvcc here"
  fi
  if [ -z "$lib" ] && [ -f "$PREBUILT" ]; then
    lib="$PREBUILT"
    echo "using the prebuilt $lib"
  fi
  if [ -z "$lib" ]; then
    echo "FAIL: no libtieredkv_kernels.so (no usable nvcc here and no $PREBUILT)"
    return 1
  fi
  echo "library: $lib"
  echo "$lib" >"$OUT/library.txt"
}
export -f build_library

run_tests() {
  if ! "$PYTHON" -c "import pytest" >/dev/null 2>&1; then
    echo "FAIL: pytest is not importable (carry build/pydeps, see the header of tools/gpu_check.sh)"
    return 1
  fi
  # run from $OUT: the checkout's root would shadow build/pysite with its bare tieredkv/ directory
  cd "$OUT" && "$PYTHON" -m pytest -c "$ROOT/pyproject.toml" --rootdir "$ROOT" -m cuda "$ROOT/tests/plugins" "$ROOT/tests/runtime/test_device.py" -q -rs \
    -p no:cacheprovider --junitxml="$OUT/tests.xml"
}
export -f run_tests

run_e2e() {
  # the end-to-end decode of the model on CUDA (SmolLM2), owned by tools/bench_gpu_decode.py
  if [ ! -f "$ROOT/tools/bench_gpu_decode.py" ]; then
    echo "SKIPPED: tools/bench_gpu_decode.py is not in this checkout (the end-to-end decode check is not here yet)"
    return 0
  fi
  # SmolLM2's shape (its checkpoint when the model cache holds it), full vs tiered 25 %
  cd "$OUT" && "$PYTHON" "$ROOT/tools/bench_gpu_decode.py" --contexts 2048 8000 --new-tokens 32 --out "$OUT"
}
export -f run_e2e

echo "== gpu_check.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname); out: $OUT"
stage device 30 bash -c check_device
stage build "${TKV_BUILD_S:-150}" bash -c build_library
LIB="$(cat "$OUT/library.txt" 2>/dev/null || true)"

# tieredkv from this checkout, installed or not: build/pysite/tieredkv mirrors pyproject's package-dir
SITE="$ROOT/build/pysite"
rm -rf "$SITE" && mkdir -p "$SITE/tieredkv"
for f in "$ROOT"/tieredkv/*.py; do ln -s "$f" "$SITE/tieredkv/"; done
for pkg in models runtime plugins builder; do ln -s "$ROOT/$pkg" "$SITE/tieredkv/$pkg"; done
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
[ -d "$ROOT/build/pydeps" ] && export PYTHONPATH="$PYTHONPATH:$ROOT/build/pydeps"

if [ -n "$LIB" ]; then
  export TIEREDKV_KERNELS="$LIB"
  stage tests "${TKV_TESTS_S:-150}" bash -c run_tests
  stage bench "${TKV_BENCH_S:-150}" "$PYTHON" "$ROOT/tools/bench_kernels.py" --lib "$LIB" --out "$OUT" "$@"
else
  printf 'tests\tskipped (no library)\t0\nbench\tskipped (no library)\t0\n' >>"$STAGES"
fi
stage e2e "${TKV_E2E_S:-105}" bash -c run_e2e

# ---- the report --------------------------------------------------------------------------------
"$PYTHON" - "$OUT" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
stages = []
for line in (out / "stages.tsv").read_text().splitlines():
    name, rc, seconds = line.split("\t")
    log = out / f"{name}.log"
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.is_file() else []
    stages.append({"stage": name, "exit": int(rc) if rc.lstrip("-").isdigit() else rc, "seconds": int(seconds),
                   "last_line": tail[0] if tail else ""})
env = {}
if (out / "device.env").is_file():
    env = dict(line.split("=", 1) for line in (out / "device.env").read_text().splitlines() if "=" in line)
bench = json.loads((out / "bench_kernels.json").read_text()) if (out / "bench_kernels.json").is_file() else {}
e2e_skipped = any(s["stage"] == "e2e" and s["last_line"].startswith("SKIPPED") for s in stages)
ok = all(s["exit"] == 0 for s in stages)  # "skipped (no library)" is not 0 either
report = {"ok": ok, "device": env, "library": (out / "library.txt").read_text().strip()
          if (out / "library.txt").is_file() else None, "stages": stages, "e2e_skipped": e2e_skipped,
          "mismatches": [c["name"] for c in bench.get("checks", []) if not c["ok"]],
          "copy_gbps": bench.get("copy_gbps")}
(out / "gpu_check.json").write_text(json.dumps(report, indent=2))
lines = ["# tieredkv GPU check", "", f"- result: **{'PASS' if ok else 'FAIL'}**",
         f"- device: {bench.get('device', '?')}; driver {env.get('DRIVER', '?')} (CUDA {env.get('DRIVER_CUDA', '?')}); "
         f"nvcc {env.get('NVCC', 'none')}", f"- library: `{report['library']}`", "",
         "| stage | exit | seconds | last line |", "|---|---|---|---|"]
lines += [f"| {s['stage']} | {s['exit']} | {s['seconds']} | {s['last_line'].replace('|', '/')[:160]} |" for s in stages]
if report["mismatches"]:
    lines += ["", "Mismatches: " + "; ".join(report["mismatches"])]
md = out / "bench_kernels.md"
if md.is_file():
    lines += ["", md.read_text().replace("# tieredkv kernel check and benchmark", "## Kernels (bench_kernels.md)")]
(out / "gpu_check.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines[:12 + len(stages)]))
sys.exit(0 if ok else 1)
EOF
