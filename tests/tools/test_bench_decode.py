"""tools/bench_decode.py's summary over rounds (medians, ratios within a round, outputs) and its
rows interleaved in one process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_decode as bd  # noqa: E402


def test_ratios_are_taken_within_each_round():
    # the machine drifts: round 2 runs everything 2x faster; the row is 0.9x paged in both
    rounds = [{"paged": {"decode_tok_s": 100.0, "outputs": [[1], [2]]},
               "tiered-all": {"decode_tok_s": 90.0, "outputs": [[1], [2]]}},
              {"paged": {"decode_tok_s": 200.0, "outputs": [[1], [2]]},
               "tiered-all": {"decode_tok_s": 180.0, "outputs": [[1], [3]]}},
              {"paged": {"decode_tok_s": 110.0, "outputs": [[1], [2]]},
               "tiered-all": {"decode_tok_s": 99.0, "outputs": [[1], [2]]}}]
    got = bd.summarize(16, "tiered-all", rounds)
    assert got["vs_paged"] == 0.9  # the ratio of the medians would be 99 / 110 = 0.9 too, but not in general:
    assert got["ratios"] == [0.9, 0.9, 0.9]
    assert got["decode_tok_s"] == 99.0  # the median of 90, 180, 99
    assert got["equal_to_paged"] == 1  # the worst round counts
    drift = [{"paged": {"decode_tok_s": p}, "row": {"decode_tok_s": r}} for p, r in ((100, 95), (200, 110), (100, 96))]
    assert bd.summarize(1, "row", drift)["vs_paged"] == 0.95  # median of 0.95, 0.55, 0.96; medians' ratio: 0.96


def test_skipped_rows_stay_skipped():
    rounds = [{"paged": {"decode_tok_s": 10.0}, "vllm": {"skipped": "no peer venv"}}] * 2
    got = bd.summarize(1, "vllm", rounds)
    assert got["skipped"] == "no peer venv" and got["decode_tok_s"] is None and got["vs_paged"] is None
    assert bd.summarize(1, "paged", rounds)["vs_paged"] == 1.0


@pytest.mark.slow
def test_interleaved_rows_run_in_one_process_round_by_round(tmp_path, smollm, pg_ids):
    # the real model, two short prompts: each round has every row, its outputs are the paged
    # row's, and a budget below the hot windows is a skipped row in every round, not a failure
    pf = tmp_path / "prompts.json"
    pf.write_text(json.dumps([pg_ids[:200], pg_ids[200:380]]))
    rows = ["paged", "tiered-all", "tiered-12.5"]
    got = bd.run_rows(rows, str(pf), new_tokens=3, repeats=1, threads=1, rounds=2)
    assert len(got) == 2 and all(list(r) == rows for r in got)
    for r in got:
        assert r["paged"]["decode_tokens"] == 4 and r["paged"]["decode_tok_s"] > 0
        assert r["tiered-all"]["outputs"] == r["paged"]["outputs"] and len(r["paged"]["outputs"][0]) == 3
        assert "ConfigError" in r["tiered-12.5"]["skipped"]
    assert bd.summarize(2, "tiered-all", got)["equal_to_paged"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("interleave", [False, True])
def test_the_table_has_every_row_a_process_of_its_own_or_interleaved(tmp_path, smollm, interleave):
    # the whole command, tiny: a row per process (paged-torch always, as it switches the kernels)
    # or the rows interleaved in one; every row timed and its outputs compared in the table
    cmd = [sys.executable, str(Path(bd.__file__)), "--batches", "1", "--prompt-len", "200", "--new-tokens", "3",
           "--rows", "paged", "paged-torch", "tiered-all", "--threads", "1", "--out", str(tmp_path)]
    subprocess.run(cmd + (["--interleave"] if interleave else []), check=True, capture_output=True)
    rows = {r["row"]: r for r in json.loads((tmp_path / "results.json").read_text())}
    assert list(rows) == ["paged", "paged-torch", "tiered-all"]
    for r in rows.values():
        assert r["decode_tok_s"] > 0 and r["vs_paged"] > 0 and r["equal_to_paged"] == 1 and not r["skipped"]
