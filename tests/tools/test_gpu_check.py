"""tools/gpu_check.sh --dry-run on this machine (every stage a stub that writes what the stage
writes): what a lent GPU machine's one call would leave — at most 8 files under $OUT, with the
expected names; a time plan within the hard total of 480 s whose limits leave every later stage
its plan; the summary (and the log archive) present after every stage, so a kill keeps what
finished; a stage over its limit cut at it while the check stays within its total."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
STAGES = ["device", "build", "tests", "bench", "e2e"]
FILES = {"gpu_check.json", "gpu_check.md", "logs.tar.gz", "bench_kernels.json", "bench_kernels.md",
         "bench_gpu_decode.json", "bench_gpu_decode.md"}
MAX_FILES = 8
TOTAL = 480


def dry_run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TKV_")}
    environ.update(OUT=str(out), TKV_WORK=str(tmp_path / "work"), **env)
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=environ, timeout=120)
    return proc, out


def files_under(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if p.is_file()]


def test_dry_run_leaves_the_expected_files_and_a_plan_within_the_total(tmp_path):
    start = time.monotonic()
    proc, out = dry_run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert time.monotonic() - start < 60
    files = files_under(out)
    assert len(files) <= MAX_FILES and {p.name for p in files} == FILES
    assert all(p.parent == out for p in files)  # nothing in folders (the device tool returns two levels at most)
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["ok"] and report["final"] and report["dry_run"] and report["total_s"] == TOTAL
    assert [s["stage"] for s in report["stages"]] == STAGES and all(s["exit"] == 0 for s in report["stages"])
    plan = {p["stage"]: p for p in report["plan"]}
    assert list(plan) == STAGES
    grace, after, final = 3, 2, 10  # timeout's kill grace, the bookkeeping per stage, the end (tools/gpu_check.sh)
    # every stage may use its whole plan (the plans, grace and bookkeeping fit the total), ...
    assert sum(p["plan_s"] + grace + after for p in plan.values()) + final <= TOTAL
    # ... and a stage's limit always leaves the later stages their plans before the deadline
    for i, name in enumerate(STAGES):
        later = sum(plan[s]["plan_s"] + grace + after for s in STAGES[i + 1:])
        assert plan[name]["started_at_s"] + plan[name]["limit_s"] + grace + after + later + final <= TOTAL
        assert plan[name]["limit_s"] >= plan[name]["plan_s"]
    md = (out / "gpu_check.md").read_text()
    assert "**PASS**" in md and all(f"| {s} | 0 |" in md for s in STAGES)
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"logs/{s}.log" for s in STAGES} | {"logs/plan.tsv", "logs/stages.tsv", "logs/tests.xml"} <= names


@pytest.mark.parametrize("killed_at", STAGES[1:])
def test_a_kill_keeps_the_summary_of_the_finished_stages(tmp_path, killed_at):
    """The check killed outright (SIGKILL) at the start of a stage: the summary and the logs of
    every stage before it are in $OUT, marked as not final, and nothing else is."""
    proc, out = dry_run(tmp_path, TKV_DRY_KILL_AT=killed_at)
    assert proc.returncode in (-9, 137)  # SIGKILL
    done = STAGES[: STAGES.index(killed_at)]
    report = json.loads((out / "gpu_check.json").read_text())
    assert not report["final"] and not report["ok"]
    assert [s["stage"] for s in report["stages"]] == done
    assert "IN PROGRESS" in (out / "gpu_check.md").read_text()
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {f"logs/{s}.log" for s in done} <= set(tar.getnames())
    assert len(files_under(out)) <= MAX_FILES
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no half-written file


def test_a_stage_over_its_limit_is_cut_and_the_check_keeps_its_total(tmp_path):
    """A small total (60 s; the build planned for 1 s, the others 3 s — slack of a few seconds, so
    that whole-second clocks under load do not squeeze a later stage out): the build stub sleeps
    past its limit and is killed with its whole process group (exit 124); the later stages still
    run, in time."""
    start = time.monotonic()
    proc, out = dry_run(tmp_path, TKV_TOTAL_S="60", TKV_DEVICE_S="3", TKV_BUILD_S="1", TKV_TESTS_S="3",
                        TKV_BENCH_S="3", TKV_E2E_S="3", TKV_DRY_SLEEP="build=60")
    elapsed = time.monotonic() - start
    assert proc.returncode == 1 and elapsed < 60
    report = json.loads((out / "gpu_check.json").read_text())
    stages = {s["stage"]: s for s in report["stages"]}
    assert stages["build"]["exit"] == 124 and stages["build"]["timed_out"]
    assert stages["build"]["seconds"] <= stages["build"]["limit_s"] + 3
    assert all(stages[s]["exit"] == 0 for s in ("device", "tests", "bench", "e2e"))
    assert not report["ok"] and "(time)" in (out / "gpu_check.md").read_text()


def test_a_plan_over_the_total_is_refused_before_anything_runs(tmp_path):
    proc, out = dry_run(tmp_path, TKV_BUILD_S="400")
    assert proc.returncode == 2 and "over the total of 480 s" in proc.stderr
    assert not out.exists() or not files_under(out)


def test_a_subset_of_stages_for_a_rerun(tmp_path):
    """TKV_STAGES runs some stages (device first, always); an unknown stage is refused."""
    proc, out = dry_run(tmp_path, TKV_STAGES="tests bench")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    assert [s["stage"] for s in report["stages"]] == ["device", "tests", "bench"] and report["ok"]
    assert {p.name for p in files_under(out)} == FILES - {"bench_gpu_decode.json", "bench_gpu_decode.md"}
    proc, _ = dry_run(tmp_path, TKV_STAGES="tests bogus")
    assert proc.returncode == 2 and "unknown stage bogus" in proc.stderr
