"""tools/bench_decode.py's summary over rounds: medians, ratios within a round, outputs."""

from __future__ import annotations

import sys
from pathlib import Path

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
