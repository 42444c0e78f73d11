"""The summary of tools/gpu_check.sh: ``gpu_check.json`` and ``gpu_check.md`` in ``--out``, from
what the stages left in ``--work`` (logs/plan.tsv, logs/stages.tsv, logs/device.env,
logs/libraries.env, logs/tests.xml or the tests log) and the reports in ``--out``
(bench_kernels.json). The check runs it after every stage (each file written beside and
renamed, so a kill leaves the previous summary or the new one) and once at the end
(``--final``: its exit status is the check's, 0 only when every stage ran and passed).

Standard library only: it runs where tieredkv's dependencies may not be installed.

    python tools/gpu_check_summary.py --out OUT --work WORK --total 480 --start EPOCH [--final] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
import xml.etree.ElementTree as ET
from pathlib import Path

#: what the check may leave in its output folder (the device tool returns at most 8 files)
OUT_FILES = ("gpu_check.json", "gpu_check.md", "logs.tar.gz", "bench_kernels.json", "bench_kernels.md",
             "bench_gpu_decode.json", "bench_gpu_decode.md")
MAX_FILES = 8


def _env(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    return dict(line.split("=", 1) for line in path.read_text(errors="replace").splitlines() if "=" in line)


def _tsv(path: Path) -> list[list[str]]:
    return [line.split("\t") for line in path.read_text().splitlines() if line] if path.is_file() else []


def _last_line(log: Path) -> str:
    if not log.is_file():
        return ""
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    return lines[-1] if lines else ""


def _tests(logs: Path) -> dict | None:
    """Test counts: tests.xml (JUnit) when pytest finished, else the tally of the -v lines of
    tests.log (a stage cut by its limit)."""
    xml = logs / "tests.xml"
    if xml.is_file():
        try:
            root = ET.parse(xml).getroot()
            suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
            counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
            failed = [f"{c.get('classname', '')}::{c.get('name', '')}" for c in root.iter("testcase")
                      if c.find("failure") is not None or c.find("error") is not None]
            return {**counts, "failed": failed[:40], "source": "tests.xml"}
        except (ET.ParseError, ValueError):
            pass
    log = logs / "tests.log"
    if not log.is_file():
        return None
    text = log.read_text(errors="replace")
    results = re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", text, flags=re.M)
    return {"tests": len(results), "failures": sum(r == "FAILED" for _, r in results),
            "errors": sum(r == "ERROR" for _, r in results), "skipped": sum(r == "SKIPPED" for _, r in results),
            "failed": [n for n, r in results if r in ("FAILED", "ERROR")][:40], "source": "tests.log (cut short)"}


def summarize(out: Path, work: Path, *, total: int, start: int, final: bool, dry_run: bool) -> dict:
    logs = work / "logs"
    stages = []
    for name, rc, seconds, limit in _tsv(logs / "stages.tsv"):
        stages.append({"stage": name, "exit": int(rc) if rc.lstrip("-").isdigit() else rc, "seconds": int(seconds),
                       "limit_s": int(limit), "timed_out": rc in ("124", "137"),
                       "last_line": _last_line(logs / f"{name}.log")})
    plan = [{"stage": name, "plan_s": int(p), "limit_s": int(limit), "started_at_s": int(at)}
            for name, p, limit, at in _tsv(logs / "plan.tsv")]
    bench = {}
    if (out / "bench_kernels.json").is_file():
        try:
            bench = json.loads((out / "bench_kernels.json").read_text())
        except ValueError:
            bench = {"unreadable": True}
    report = {
        "ok": final and bool(stages) and all(s["exit"] == 0 for s in stages),
        "final": final,
        "dry_run": dry_run,
        "total_s": total,
        "elapsed_s": int(time.time()) - start,
        "plan": plan,
        "stages": stages,
        "device": _env(logs / "device.env"),
        "libraries": _env(logs / "libraries.env"),
        "tests": _tests(logs),
        "mismatches": [c.get("name") for c in bench.get("checks", []) if not c.get("ok", True)],
        "copy_gbps": bench.get("copy_gbps"),
    }
    extra = sorted(p.name for p in out.iterdir() if p.name not in OUT_FILES and not p.name.startswith("."))
    report["out_files"] = sorted(set(OUT_FILES) & {p.name for p in out.iterdir()} | {"gpu_check.json", "gpu_check.md"})
    if extra:
        report["unexpected_out_files"] = extra
    _write(out / "gpu_check.json", json.dumps(report, indent=2) + "\n")
    _write(out / "gpu_check.md", markdown(report))
    return report


def markdown(r: dict) -> str:
    state = ("PASS" if r["ok"] else "FAIL") if r["final"] else "IN PROGRESS (or cut short)"
    dev = r["device"]
    lines = ["# tieredkv GPU check" + (" (dry run)" if r["dry_run"] else ""), "",
             f"- result: **{state}** after {r['elapsed_s']} s of {r['total_s']} s",
             f"- device: {dev.get('GPU', '?')}; driver {dev.get('DRIVER', '?')} (CUDA {dev.get('DRIVER_CUDA', '?')}); "
             f"compute capability {dev.get('COMPUTE_CAP', '?')}; nvcc {dev.get('NVCC', 'none')}",
             "- libraries: " + (", ".join(f"{k.lower()} `{v}`" for k, v in r["libraries"].items()) or "none"), "",
             "| stage | exit | seconds | limit (s) | last line |", "|---|---|---|---|---|"]
    for s in r["stages"]:
        line = s["last_line"].replace("|", "/")[:160]
        lines.append(f"| {s['stage']} | {s['exit']}{' (time)' if s['timed_out'] else ''} | {s['seconds']} | "
                     f"{s['limit_s']} | {line} |")
    t = r["tests"]
    if t:
        lines += ["", f"Tests ({t['source']}): {t['tests']} run, {t['failures']} failed, {t['errors']} errors, "
                      f"{t['skipped']} skipped" + (": " + "; ".join(t["failed"]) if t["failed"] else "")]
    if r["mismatches"]:
        lines += ["", "Kernel mismatches: " + "; ".join(map(str, r["mismatches"]))]
    lines += ["", "Time plan (s): " + ", ".join(f"{p['stage']} {p['plan_s']} (limit {p['limit_s']} at "
                                                f"{p['started_at_s']})" for p in r["plan"])]
    lines += ["", "Files: " + ", ".join(r["out_files"]) + " (logs: logs.tar.gz; kernel tables: bench_kernels.md)"]
    if r.get("unexpected_out_files"):
        lines += [f"Unexpected files in the output folder: {', '.join(r['unexpected_out_files'])}"]
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--total", type=int, required=True)
    ap.add_argument("--start", type=int, required=True)
    ap.add_argument("--final", action="store_true")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    report = summarize(args.out, args.work, total=args.total, start=args.start, final=args.final,
                       dry_run=args.dry_run)
    if args.final:
        print(markdown(report))
        n = len([p for p in args.out.iterdir()])
        if n > MAX_FILES:
            print(f"{n} files in {args.out}: the device tool returns {MAX_FILES}")
            return 1
    return 0 if report["ok"] or not args.final else 1


if __name__ == "__main__":
    raise SystemExit(main())
