#!/usr/bin/env bash
# The prepared GPU check: ONE call on a lent GPU machine (an H200 in mind: 600 s per command, at
# most 8 files of 16 MiB back from $OUT), which stays within a hard total of $TKV_TOTAL_S (480) s
# and leaves in $OUT, after every stage, what the finished stages found:
#   gpu_check.json, gpu_check.md   the summary (tools/gpu_check_summary.py), rewritten after every stage
#   logs.tar.gz                    every stage's log, nvidia-smi.txt, device.env, tests.xml, plan.tsv, stages.tsv
#   bench_kernels.json / .md       tools/bench_kernels.py (after the bench stage)
#   bench_gpu_decode.json / .md    tools/bench_gpu_decode.py (after the e2e stage)
# (7 files; nothing else is written under $OUT: the work lives in $TKV_WORK, default build/gpu-check).
# Stages, in order, each under a time limit derived from what is left (see "Time plan"):
#   device  nvidia-smi: driver, the CUDA version it supports, GPU, compute capability; fails clearly
#           when the driver cannot run what this nvcc builds or the GPU is older than sm_80
#   build   libtieredkv_kernels.so, and with the TensorRT headers ($TRT_INCLUDE_DIR, else the carried
#           build/gpu-carry/trt-include) libtieredkv_trt_plugins.so and libtieredkv_trt_harness.so:
#           CMake (>= 3.24) + nvcc, else nvcc alone (every file compiled in parallel), else the libraries
#           prebuilt in build/gpu-carry/lib (tools/gpu_carry.sh)
#   tests   pytest -m cuda tests/plugins tests/runtime/test_device.py: every kernel against its PyTorch
#           reference, the TensorRT plugins driven through their creators by the harness
#           (tests/plugins/test_trt_plugins.py: enqueue on device buffers, KVAppend in place), the
#           device path of the runtime
#   bench   tools/bench_kernels.py (extra arguments of this script go to it)
#   e2e     tools/bench_gpu_decode.py --contexts 2048 8000 --new-tokens 32 (SmolLM2's shape)
# --dry-run: the same script on any machine, every stage a stub that writes what the stage would
# (tests/tools/test_gpu_check.py runs it in CI). TKV_STAGES="build tests" runs a subset (device
# always first): a rerun within what is left of a loan. Exit status 0 only when every stage run passed.
#
# Time plan: stage s plans TKV_<S>_S seconds (device 15, build 150, tests 140, bench 90, e2e 45);
# each stage may also overrun by the kill grace of `timeout` (3 s) and its bookkeeping (packing the
# logs and the summary, 2 s); 10 s are kept for the end. A stage's limit is its plan plus what the
# stages before it left unused, at most what is left before the deadline minus the plans of the
# stages after it; when that is less than its minimum (device 5, 20 each else, or its plan when
# smaller) the later stages are squeezed to their minimums, and a stage is skipped when even its
# minimum does not fit. The plan is refused before anything runs when it does not fit the total.
#
# The checkout need not be installed: tieredkv is imported from it through a tree of symlinks
# ($TKV_WORK/pysite); build/gpu-carry/pydeps (pytest and the runtime's small dependencies for
# Python 3.12), when carried, goes on PYTHONPATH. The exact call on a lent machine: docs/gpu-check.md.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRY=0
BENCH_ARGS=()
for arg in "$@"; do
  if [ "$arg" = "--dry-run" ]; then DRY=1; else BENCH_ARGS+=("$arg"); fi
done
START=$(date +%s)
TOTAL="${TKV_TOTAL_S:-480}"
DEADLINE=$((START + TOTAL))
GRACE=3   # timeout --kill-after
AFTER=2   # per stage: packing the logs, the summary
FINAL=10  # kept for the end
ALL_STAGES=(device build tests bench e2e)
# TKV_STAGES: a subset to run, in this order (a rerun after a fix: "build tests"); device always runs
read -r -a STAGES <<<"${TKV_STAGES:-${ALL_STAGES[*]}}"
for s in "${STAGES[@]}"; do
  case " ${ALL_STAGES[*]} " in *" $s "*) ;; *) echo "TKV_STAGES: unknown stage $s (stages: ${ALL_STAGES[*]})" >&2
                                              exit 2 ;; esac
done
[ "${STAGES[0]}" = device ] || STAGES=(device "${STAGES[@]}")
declare -A PLAN=([device]="${TKV_DEVICE_S:-15}" [build]="${TKV_BUILD_S:-150}" [tests]="${TKV_TESTS_S:-140}"
                 [bench]="${TKV_BENCH_S:-90}" [e2e]="${TKV_E2E_S:-45}")
declare -A MIN=([device]=5 [build]=20 [tests]=20 [bench]=20 [e2e]=20)

OUT="${OUT:-$ROOT/gpu_out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="${TKV_WORK:-$ROOT/build/gpu-check}"
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
case "$WORK/" in "$OUT"/*) echo "TKV_WORK ($WORK) must not be inside OUT ($OUT): only the report goes there" >&2
                            exit 2 ;; esac
CARRY="${TKV_CARRY:-$ROOT/build/gpu-carry}"
LOGS="$WORK/logs"
rm -rf "$LOGS" "$WORK/stage-out"
mkdir -p "$LOGS" "$WORK/stage-out"
rm -f "$OUT"/gpu_check.json "$OUT"/gpu_check.md "$OUT"/logs.tar.gz "$OUT"/bench_kernels.* "$OUT"/bench_gpu_decode.* \
  "$OUT"/.*.tmp
export OUT ROOT WORK LOGS CARRY DRY

planned=0
for s in "${STAGES[@]}"; do planned=$((planned + PLAN[$s] + GRACE + AFTER)); done
if [ $((planned + FINAL)) -gt "$TOTAL" ]; then
  echo "the stage plans need $((planned + FINAL)) s with their grace and bookkeeping, over the total of $TOTAL s:" \
       "lower a TKV_<STAGE>_S" >&2
  exit 2
fi

if [ -z "${PYTHON:-}" ]; then  # the first python that has torch (any python for a dry run)
  for candidate in python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && { [ "$DRY" = 1 ] || "$candidate" -c "import torch" >/dev/null 2>&1; }; then
      PYTHON="$(command -v "$candidate")"
      break
    fi
  done
fi
export PYTHON="${PYTHON:-python3}"

# tieredkv from this checkout, installed or not: $WORK/pysite/tieredkv mirrors pyproject's package-dir
SITE="$WORK/pysite"
rm -rf "$SITE" && mkdir -p "$SITE/tieredkv"
for f in "$ROOT"/tieredkv/*.py; do ln -s "$f" "$SITE/tieredkv/"; done
for pkg in models runtime plugins builder; do ln -s "$ROOT/$pkg" "$SITE/tieredkv/$pkg"; done
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
[ -d "$CARRY/pydeps" ] && export PYTHONPATH="$PYTHONPATH:$CARRY/pydeps"
export TRT_INCLUDE_DIR="${TRT_INCLUDE_DIR:-$CARRY/trt-include}"

# ---- the stages -------------------------------------------------------------------------------

check_device() {
  : >"$LOGS/device.env"
  command -v nvcc >/dev/null 2>&1 &&
    echo "NVCC=$(nvcc --version | sed -n 's/.*release \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p')" >>"$LOGS/device.env"
  if ! nvidia-smi >"$LOGS/nvidia-smi.txt" 2>&1; then
    echo "FAIL: nvidia-smi failed (no NVIDIA driver?):"
    cat "$LOGS/nvidia-smi.txt"
    return 1
  fi
  head -n 15 "$LOGS/nvidia-smi.txt"
  local driver cc name driver_cuda
  IFS=',' read -r driver cc name < <(nvidia-smi --query-gpu=driver_version,compute_cap,name --format=csv,noheader | head -n 1)
  driver_cuda="$(sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' "$LOGS/nvidia-smi.txt" | head -n 1)"
  echo "driver ${driver// /}, supports CUDA ${driver_cuda:-?}; GPU${name}; compute capability ${cc// /}"
  printf 'DRIVER=%s\nDRIVER_CUDA=%s\nCOMPUTE_CAP=%s\nGPU=%s\n' "${driver// /}" "$driver_cuda" "${cc// /}" \
    "$(echo "$name" | sed 's/^ *//')" >>"$LOGS/device.env"
  if command -v nvcc >/dev/null 2>&1; then
    local nvcc_version
    nvcc_version="$(sed -n 's/^NVCC=//p' "$LOGS/device.env")"
    # the libraries link the CUDA runtime of their nvcc statically: the driver must support its major version
    if [ -n "$driver_cuda" ] && [ "${driver_cuda%%.*}" -lt "${nvcc_version%%.*}" ]; then
      echo "FAIL: nvcc $nvcc_version builds need a driver that supports CUDA ${nvcc_version%%.*}.x; this driver" \
           "(${driver// /}) supports CUDA $driver_cuda. The build stage will not use this nvcc (it takes the" \
           "carried prebuilt libraries, if any); update the driver or build with an older toolkit."
      echo "NVCC_TOO_NEW=1" >>"$LOGS/device.env"
      return 1
    fi
  else
    echo "no nvcc on PATH: the build stage takes the libraries prebuilt in $CARRY/lib"
  fi
  local major="${cc%%.*}"
  if [ -n "$major" ] && [ "${major// /}" -lt 8 ] 2>/dev/null; then
    echo "FAIL: compute capability $cc: the kernels need sm_80 or newer (fp8 / bf16 conversions, 16-byte loads)"
    return 1
  fi
}

# nvcc alone, the flags of CMakeLists.txt: every translation unit in parallel, then the links
build_with_nvcc() {
  local dir="$1" arch="$2" headers="$3"
  mkdir -p "$dir/obj"
  local flags=(-std=c++17 -O3 -Xcompiler -fPIC,-fvisibility=hidden,-ffp-contract=off
               "-gencode=arch=compute_${arch},code=sm_${arch}" "-gencode=arch=compute_${arch},code=compute_${arch}"
               -I"$ROOT/plugins/csrc")
  local pids=() kernel_objs=() trt_objs=() src obj ok=1
  for src in "$ROOT"/plugins/csrc/*.cu; do
    obj="$dir/obj/$(basename "$src").o"
    kernel_objs+=("$obj")
    nvcc "${flags[@]}" -c "$src" -o "$obj" &
    pids+=($!)
  done
  if [ -n "$headers" ]; then
    for src in "$ROOT"/plugins/csrc/trt/*.cpp; do
      obj="$dir/obj/$(basename "$src").o"
      trt_objs+=("$obj")
      nvcc -std=c++17 -O3 -Xcompiler -fPIC,-fvisibility=hidden -I"$ROOT/plugins/csrc" -I"$ROOT/plugins/csrc/trt" \
        -isystem "$headers" -c "$src" -o "$obj" &
      pids+=($!)
    done
    nvcc -std=c++17 -O2 -shared -Xcompiler -fPIC,-fvisibility=hidden -isystem "$headers" \
      "$ROOT/plugins/csrc/trt_harness/trt_harness.cpp" -o "$dir/libtieredkv_trt_harness.so" -ldl &
    pids+=($!)
  fi
  local pid
  for pid in "${pids[@]}"; do wait "$pid" || ok=0; done
  [ "$ok" = 1 ] || return 1
  nvcc -shared "${kernel_objs[@]}" -o "$dir/libtieredkv_kernels.so" -Xlinker -z -Xlinker defs || return 1
  if [ -n "$headers" ]; then
    nvcc -shared "${kernel_objs[@]}" "${trt_objs[@]}" -o "$dir/libtieredkv_trt_plugins.so" -Xlinker -z -Xlinker defs ||
      return 1
  fi
}

build_libraries() {
  # shellcheck disable=SC1091
  [ -f "$LOGS/device.env" ] && . "$LOGS/device.env"
  local arch="${COMPUTE_CAP:-9.0}" dir="$WORK/build" headers="" built=0
  arch="${arch//./}"
  if [ -f "$TRT_INCLUDE_DIR/NvInfer.h" ]; then
    headers="$TRT_INCLUDE_DIR"
    echo "TensorRT headers: $headers ($(sed -n 's/^#define TRT_\(MAJOR\|MINOR\)_ENTERPRISE \([0-9]*\)/\2/p' \
      "$headers/NvInferVersion.h" | paste -sd.))"
  else
    echo "no TensorRT headers ($TRT_INCLUDE_DIR): the kernels library only; the plugin tests will skip"
  fi
  if [ "${NVCC_TOO_NEW:-0}" = 1 ]; then
    echo "not building: this driver cannot run what this nvcc builds (device.log)"
  elif command -v nvcc >/dev/null 2>&1; then
    nvcc --version | tail -n 2
    local v cmake_ok=0
    if command -v cmake >/dev/null 2>&1; then
      v="$(cmake --version | sed -n 's/cmake version \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')"
      set -- $v
      if [ "${1:-0}" -gt 3 ] || { [ "${1:-0}" -eq 3 ] && [ "${2:-0}" -ge 24 ]; }; then cmake_ok=1; fi
    fi
    if [ "$cmake_ok" = 1 ]; then
      local gen=()
      command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
      cmake -S "$ROOT/plugins/csrc" -B "$dir" "${gen[@]}" -DCMAKE_CUDA_ARCHITECTURES="${arch}-real;${arch}-virtual" \
        -DTRT_INCLUDE_DIR="$headers" && cmake --build "$dir" -j "$(nproc)" && built=1
    else
      echo "no CMake >= 3.24: nvcc alone"
      build_with_nvcc "$dir" "$arch" "$headers" && built=1
    fi
    [ "$built" = 1 ] || echo "the build FAILED (above)"
  fi
  local lib
  : >"$LOGS/libraries.env"
  for lib in kernels trt_plugins trt_harness; do
    local path="$dir/libtieredkv_${lib}.so"
    if [ "$built" != 1 ] || [ ! -f "$path" ]; then
      path="$CARRY/lib/libtieredkv_${lib}.so"
      [ -f "$path" ] && echo "using the prebuilt $path"
    fi
    [ -f "$path" ] && echo "$(echo "$lib" | tr a-z A-Z)=$path" >>"$LOGS/libraries.env"
  done
  cat "$LOGS/libraries.env"
  grep -q '^KERNELS=' "$LOGS/libraries.env" || { echo "FAIL: no libtieredkv_kernels.so"; return 1; }
}

libraries() {  # the libraries the build stage found, as the tests and benchmarks take them
  # shellcheck disable=SC1091
  [ -f "$LOGS/libraries.env" ] && . "$LOGS/libraries.env"
  export TIEREDKV_KERNELS="${KERNELS:-}" TIEREDKV_TRT_PLUGINS="${TRT_PLUGINS:-}" TIEREDKV_TRT_HARNESS="${TRT_HARNESS:-}"
}

run_tests() {
  libraries
  [ -n "$TIEREDKV_KERNELS" ] || { echo "FAIL: no kernels library (build stage)"; return 1; }
  "$PYTHON" -c "import pytest" 2>/dev/null || { echo "FAIL: pytest is not importable (carry build/gpu-carry/pydeps)"; return 1; }
  # -v: a line per test as it ends, so a stage cut by its limit still says which tests passed
  cd "$WORK" && "$PYTHON" -m pytest -c "$ROOT/pyproject.toml" --rootdir "$ROOT" -m cuda -v -rs -p no:cacheprovider \
    --junitxml="$LOGS/tests.xml" "$ROOT/tests/plugins" "$ROOT/tests/runtime/test_device.py"
}

run_bench() {  # arguments: this script's extra arguments
  libraries
  [ -n "$TIEREDKV_KERNELS" ] || { echo "FAIL: no kernels library (build stage)"; return 1; }
  cd "$WORK" && "$PYTHON" "$ROOT/tools/bench_kernels.py" --lib "$TIEREDKV_KERNELS" --out "$WORK/stage-out" "$@"
}

run_e2e() {
  cd "$WORK" && "$PYTHON" "$ROOT/tools/bench_gpu_decode.py" --contexts 2048 8000 --new-tokens 32 --out "$WORK/stage-out"
}

# --dry-run: each stage a stub that writes the files the stage writes (tiny, marked dry)
dry_stage() {
  local name="$1" sleep_s
  sleep_s="$(echo "${TKV_DRY_SLEEP:-}" | tr ',' '\n' | sed -n "s/^$name=//p")"
  echo "dry run: stage $name stubbed (limit ${STAGE_LIMIT}s)"
  [ -n "$sleep_s" ] && sleep "$sleep_s"
  case "$name" in
    device) printf 'DRIVER=dry\nDRIVER_CUDA=dry\nCOMPUTE_CAP=9.0\nGPU=dry run\n' >"$LOGS/device.env"
            echo "dry run: no nvidia-smi" >"$LOGS/nvidia-smi.txt" ;;
    build) printf 'KERNELS=%s\n' "$WORK/build/libtieredkv_kernels.so" >"$LOGS/libraries.env" ;;
    tests) printf '<testsuites><testsuite name="pytest" tests="0" failures="0" errors="0" skipped="0"/></testsuites>\n' \
             >"$LOGS/tests.xml" ;;
    bench) printf '{"dry_run": true, "checks": []}\n' >"$WORK/stage-out/bench_kernels.json"
           printf '# tieredkv kernel check and benchmark\n\ndry run\n' >"$WORK/stage-out/bench_kernels.md" ;;
    e2e) printf '{"dry_run": true}\n' >"$WORK/stage-out/bench_gpu_decode.json"
         printf '# end-to-end decode\n\ndry run\n' >"$WORK/stage-out/bench_gpu_decode.md" ;;
  esac
}
export -f check_device build_with_nvcc build_libraries libraries run_tests run_bench run_e2e dry_stage

# ---- the stage runner, the bookkeeping ---------------------------------------------------------

finish_stage() {  # what every stage ends with, so that a kill keeps what finished
  local f
  for f in bench_kernels.json bench_kernels.md bench_gpu_decode.json bench_gpu_decode.md; do
    [ -f "$WORK/stage-out/$f" ] && cp "$WORK/stage-out/$f" "$OUT/.$f.tmp" && mv "$OUT/.$f.tmp" "$OUT/$f"
  done
  # written beside, then renamed: a kill leaves the previous archive or the new one, never half of one
  tar -czf "$OUT/.logs.tar.gz.tmp" -C "$WORK" logs && mv "$OUT/.logs.tar.gz.tmp" "$OUT/logs.tar.gz"
  "$PYTHON" "$ROOT/tools/gpu_check_summary.py" --out "$OUT" --work "$WORK" --total "$TOTAL" --start "$START" \
    $([ "$DRY" = 1 ] && echo --dry-run) >/dev/null || echo "the summary could not be written"
}

least() {  # the least time stage $1 is worth running with: its minimum, or its plan when smaller
  local s="$1"
  echo $((PLAN[$s] < MIN[$s] ? PLAN[$s] : MIN[$s]))
}

run_stage() {
  local name="$1" func="$2" i="$3" now left later later_min limit rc start j s
  now=$(date +%s)
  left=$((DEADLINE - now - FINAL))
  later=0
  later_min=0
  for ((j = i + 1; j < ${#STAGES[@]}; j++)); do
    s="${STAGES[$j]}"
    later=$((later + PLAN[$s] + GRACE + AFTER))
    later_min=$((later_min + $(least "$s") + GRACE + AFTER))
  done
  limit=$((left - later - GRACE - AFTER))
  # at most its plan plus what the stages before it left unused
  local banked=$((PLANNED_SO_FAR - (now - START)))
  [ "$banked" -lt 0 ] && banked=0
  [ "$limit" -gt $((PLAN[$name] + banked)) ] && limit=$((PLAN[$name] + banked))
  [ "$limit" -lt "$(least "$name")" ] && limit=$((left - later_min - GRACE - AFTER))
  PLANNED_SO_FAR=$((PLANNED_SO_FAR + PLAN[$name] + GRACE + AFTER))
  printf '%s\t%s\t%s\t%s\n' "$name" "${PLAN[$name]}" "$limit" "$((now - START))" >>"$LOGS/plan.tsv"
  if [ "$limit" -lt "$(least "$name")" ]; then
    echo "== $name: skipped, ${left} s left before the deadline"
    printf '%s\tskipped\t0\t%s\n' "$name" "$limit" >>"$LOGS/stages.tsv"
    finish_stage
    return
  fi
  if [ "$DRY" = 1 ] && [ "${TKV_DRY_KILL_AT:-}" = "$name" ]; then
    echo "dry run: killed at the start of $name (TKV_DRY_KILL_AT)"
    kill -9 $$
  fi
  echo "== $name (limit ${limit}s, $((now - START))s into the check)"
  start=$(date +%s)
  if [ "$DRY" = 1 ]; then
    STAGE_LIMIT="$limit" timeout --kill-after="$GRACE" "$limit" bash -c "dry_stage $name" 2>&1 | tee "$LOGS/$name.log"
  else
    timeout --kill-after="$GRACE" "$limit" bash -c "$func" 2>&1 | tee "$LOGS/$name.log"
  fi
  rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - start))" "$limit" >>"$LOGS/stages.tsv"
  echo "== $name: exit $rc$([ "$rc" = 124 ] || [ "$rc" = 137 ] && echo " (out of time)")"
  finish_stage
}

export STAGE_LIMIT=0
PLANNED_SO_FAR=0
: >"$LOGS/stages.tsv"
: >"$LOGS/plan.tsv"
echo "== gpu_check.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)$([ "$DRY" = 1 ] && echo " (dry run)"); total" \
     "${TOTAL}s; out: $OUT; work: $WORK"
BENCH_ARGS_STR="${BENCH_ARGS[*]:-}"
export BENCH_ARGS_STR
i=0
for name in "${STAGES[@]}"; do
  case "$name" in
    device) func=check_device ;;
    build) func=build_libraries ;;
    tests) func=run_tests ;;
    bench) func="run_bench $BENCH_ARGS_STR" ;;
    e2e) func=run_e2e ;;
  esac
  run_stage "$name" "$func" "$i"
  i=$((i + 1))
done
"$PYTHON" "$ROOT/tools/gpu_check_summary.py" --out "$OUT" --work "$WORK" --total "$TOTAL" --start "$START" --final \
  $([ "$DRY" = 1 ] && echo --dry-run)
