"""One quality-vs-budget table (and plot) from several kvpress_compare result stores.

    python tools/eval/quality_table.py results/kvpress results/tiered --out results/quality [--windows N]

Perplexity is recomputed over the first N windows common to every row (each window
scores the same number of tokens, so the perplexity of the first N windows is the
geometric mean of their per-window perplexities); by default N is the smallest number
of windows any row measured. A column gives each row's mean device-resident KV on the
perplexity protocol as a share of the full cache: tieredkv rows hold their budget for
the whole window (measured); a kvpress press keeps b of the context (3/4 of the window)
and then every scored token, i.e. 0.75 b + 0.125 on average.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvpress_compare import load_store, write_plot, write_table  # noqa: E402


def merge(stores: list[dict], windows: int | None) -> tuple[dict, int]:
    merged = {"schema": stores[0]["schema"], "meta": copy.deepcopy(stores[0].get("meta", {})), "results": {}}
    for s in stores:
        merged["results"].update(copy.deepcopy(s["results"]))
    ppl = [e for e in merged["results"].values() if e["metric"] == "perplexity"]
    n = windows or min(len(e["result"]["window_ppl"]) for e in ppl)
    for e in ppl:
        w = e["result"]["window_ppl"][:n]
        if len(w) < n:
            raise SystemExit(f"error: {e['row']}@{e['budget']} has {len(w)} windows, fewer than {n}")
        e["result"]["perplexity"] = math.exp(sum(math.log(x) for x in w) / n)
    if merged["meta"].get("perplexity"):
        merged["meta"]["perplexity"]["windows_used"] = n
    return merged, n


def resident_share(entry: dict, kv_bytes_per_token: int) -> float:
    """Mean device-resident KV as a share of the full cache on the perplexity protocol."""
    if entry.get("reference"):
        return 1.0
    res = entry["result"]
    fraction = res.get("context_fraction", 0.75)
    if entry.get("backend") == "kvpress":
        return fraction * entry["budget"] + (1 - fraction) / 2
    mean = (res.get("stats") or {}).get("resident_bytes_mean")
    bpt = res.get("method", {}).get("kv_bytes_per_token", kv_bytes_per_token)
    return mean / (res["window"] * bpt)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stores", nargs="+", type=Path, help="kvpress_compare output directories")
    ap.add_argument("--windows", type=int, default=None)
    ap.add_argument("--kv-bytes-per-token", type=int, default=46080,
                    help="K+V bytes per token, all layers, for rows that did not record it (SmolLM2 fp32: 46080)")
    ap.add_argument("--out", type=Path, default=Path("results/quality"))
    args = ap.parse_args()
    stores = [load_store(d / "results.json") for d in args.stores]
    merged, n = merge(stores, args.windows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(merged, indent=1, default=str))
    table = write_table(merged, args.out)
    write_plot(merged, args.out)
    shares = {}
    for e in merged["results"].values():
        if e["metric"] == "perplexity":
            shares[(e["row"], e["budget"])] = resident_share(e, args.kv_bytes_per_token)
    lines = ["", f"Mean device-resident KV on the perplexity protocol, % of the full cache (first {n} windows):", "",
             "| method | budget % | resident % |", "|---|---:|---:|"]
    lines += [f"| {row} | {100 * b:g} | {100 * s:.1f} |" for (row, b), s in shares.items()]
    with open(table, "a") as fh:
        fh.write("\n".join(lines) + "\n")
    print(table.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
