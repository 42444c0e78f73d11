"""tools/plot_quality_vs_bytes.py: collects the suite's cells into a small JSON and draws the
README's plot from it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import plot_quality_vs_bytes as pq  # noqa: E402

pytest.importorskip("matplotlib")

TEXTS = ("a", "b")


def _cell(method, budget, text, task, value, peak=None):
    if task == "perplexity":
        res = {"perplexity": value, "stats": {} if peak is None else {"kv_fp16_fraction_peak": peak}}
        params = {"windows": 1}
    else:
        res = {"accuracy": value, "mean_logprob": -1.0}
        params = {"trials": 2}
    return {"method": method, "spec": method, "budget": budget, "text": text, "task": task, "context": 2048,
            "params": params, "result": res}


def _store(tmp_path: Path, name: str, cells: list[dict]) -> Path:
    d = tmp_path / name
    d.mkdir()
    results = {f"{c['method']}@{c['budget']:g}/{c['text']}/{c['task']}@2048": c for c in cells}
    (d / "results.json").write_text(json.dumps({"results": results}))
    return d


def test_collect_then_plot_writes_a_png(tmp_path):
    tiered = _store(tmp_path, "tiered", [
        *[_cell("full", 1.0, t, "perplexity", 10.0) for t in TEXTS],
        *[_cell("full", 1.0, t, "passkey", 1.0) for t in TEXTS],
        *[_cell("default-fp16", b, t, "perplexity", 10.0 + 10 * (0.25 - b)) for t in TEXTS for b in (0.25, 0.125)],
        *[_cell("default-fp16", 0.25, t, "passkey", 1.0) for t in TEXTS],
        _cell("unrelated", 0.25, "a", "perplexity", 99.0),
    ])
    quant = _store(tmp_path, "quant", [
        *[_cell("quantized-int4", 0.28125, t, "perplexity", 10.5, peak=0.326) for t in TEXTS],
        _cell("quantized-int4+snapkv", 0.125, "a", "perplexity", 12.0),  # one text only: no point drawn
    ])
    js, png = tmp_path / "q.json", tmp_path / "q.png"
    assert pq.main(["--stores", str(tiered), str(quant), "--json", str(js), "--texts", *TEXTS]) == 0
    data = json.loads(js.read_text())
    assert [(e["method"], e["fp16_bytes"]) for e in data["entries"]] == [
        ("full", 1.0), ("default-fp16", 0.25), ("default-fp16", 0.125), ("quantized-int4", 0.28125),
        ("quantized-int4+snapkv", 0.125)]
    assert data["entries"][3]["fp16_bytes_peak"] == 0.326
    s = pq.series(data, TEXTS)
    assert s["full"]["passkey"] == 1.0
    assert s["methods"]["default-fp16"]["ppl"] == [(12.5, pytest.approx(12.5)), (25.0, 0.0)]
    assert s["methods"]["default-fp16"]["passkey"] == [(25.0, 1.0)]
    assert s["methods"]["quantized-int4+snapkv"]["ppl"] == []
    assert not png.exists()  # collecting alone draws nothing
    assert pq.main(["--json", str(js), "--png", str(png), "--texts", *TEXTS]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_series_needs_the_full_cache():
    with pytest.raises(ValueError, match="full"):
        pq.series({"entries": [{"method": "x", "fp16_bytes": 0.25, "perplexity": {}, "tasks": {}}]})
