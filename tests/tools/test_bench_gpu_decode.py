"""tools/bench_gpu_decode.py on the CPU (the same code tools/gpu_check.sh runs on a GPU): the
attend-all tiered run gives the full cache's tokens, the report has every run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_gpu_decode_runs_and_checks_exactness(tmp_path):
    # 800 tokens: 50 % of their float16 bytes is 200 float32 tokens, room for T0 and the staging area
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_gpu_decode.py"), "--device", "cpu", "--preset",
                           "smollm2-135m", "--contexts", "800", "--new-tokens", "3", "--budget", "50%", "--dtype", "float32",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "bench_gpu_decode.json").read_text())["rows"]
    by = {r["cache"]: r for r in rows}
    assert set(by) == {"full", "tiered-50%-attend-all", "tiered-50%", "tiered-50%-masked"}
    assert by["tiered-50%-attend-all"]["tokens"] == by["full"]["tokens"]
    assert by["tiered-50%-attend-all"]["misses"] > by["tiered-50%"]["misses"] > 0
    assert "| 800 | full |" in (tmp_path / "bench_gpu_decode.md").read_text()
