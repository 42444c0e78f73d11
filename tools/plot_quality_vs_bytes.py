"""Quality against KV bytes: the README's plot (issue #35).

Two steps, both reproducible:

    # 1. collect the cells the plot shows from the evaluation suite's result stores into a small JSON
    python tools/plot_quality_vs_bytes.py --stores results/i35-tiered results/i35-quant results/i35-q4p125 \
        --json docs/quality_vs_bytes.json
    # 2. draw it (what the README shows; step 1 is only needed when the stores change)
    python tools/plot_quality_vs_bytes.py --json docs/quality_vs_bytes.json --png docs/quality_vs_bytes.png

The JSON keeps one entry per (method, budget) with its perplexity and each task's accuracy and mean
answer log-probability per text, taken as the suite stored them (nothing is recomputed but the
means the plot draws). x is the share of the full cache's float16 bytes the method is given (a
quantized cache alone: its nominal share, codes with their scales and zero points); y, the
perplexity change against the full cache on the same window, mean over the texts named by
``--texts`` (default: the four held-out texts), and the passkey accuracy. A point is drawn only
where every one of those texts has the cell.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HELD_OUT = ("as-you-like-it", "licenses", "world-factbook", "loc-workshop")
TASKS = ("passkey", "multikey")

# the suite's method names -> the plot's series (label, kind); the kind picks the style
SERIES = {
    "full": ("full cache", "full"),
    "default-fp16": ("tieredkv default, fp16 pages", "tiered"),
    "quantized-int4": ("QuantizedCache int4 (HQQ)", "peer"),
    "quantized-int2": ("QuantizedCache int2 (HQQ)", "peer"),
    "quantized-int4+snapkv": ("QuantizedCache int4 + SnapKV", "peer"),
    "quantized-int2+snapkv": ("QuantizedCache int2 + SnapKV", "peer"),
}


def collect(stores: Sequence[Path], methods: Sequence[str] = tuple(SERIES)) -> dict[str, Any]:
    """The cells of ``methods`` in the suite stores (``DIR/results.json`` or the file itself),
    grouped by (method, budget); a later store's cell replaces an earlier one's."""
    entries: dict[tuple[str, float], dict[str, Any]] = {}
    contexts: set[int] = set()
    for store in stores:
        path = store / "results.json" if store.is_dir() else store
        for cell in json.loads(path.read_text())["results"].values():
            if cell["method"] not in methods:
                continue
            contexts.add(cell["context"])
            e = entries.setdefault((cell["method"], cell["budget"]), {
                "method": cell["method"], "spec": cell["spec"], "fp16_bytes": cell["budget"],
                "perplexity": {}, "tasks": {}})
            res = cell["result"]
            if cell["task"] == "perplexity":
                e["perplexity"][cell["text"]] = res["perplexity"]
                peak = res.get("stats", {}).get("kv_fp16_fraction_peak")
                if peak is not None:
                    e["fp16_bytes_peak"] = max(e.get("fp16_bytes_peak", 0.0), peak)
            else:
                e["tasks"].setdefault(cell["task"], {})[cell["text"]] = {
                    "accuracy": res["accuracy"], "mean_logprob": res["mean_logprob"],
                    "trials": cell["params"].get("trials")}
    order = list(methods)
    rows = sorted(entries.values(), key=lambda e: (order.index(e["method"]), -e["fp16_bytes"]))
    return {"what": "issue #35 cells: perplexity and task accuracy per text against the share of the full "
                    "cache's float16 KV bytes (SmolLM2-135M-Instruct, one window / the suite's trials)",
            "contexts": sorted(contexts), "entries": rows}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def series(data: dict[str, Any], texts: Sequence[str] = HELD_OUT) -> dict[str, Any]:
    """Per method: [(x %, mean Δppl %)] and [(x %, mean passkey accuracy)] over ``texts``, plus the
    full cache's figures; a point only where every text has the cell."""
    full = next((e for e in data["entries"] if e["method"] == "full"), None)
    if full is None:
        raise ValueError("the data holds no full-cache entry to compare against")
    out: dict[str, Any] = {"full": {"passkey": None}, "methods": {}}
    fk = full["tasks"].get("passkey", {})
    if all(t in fk for t in texts):
        out["full"]["passkey"] = _mean([fk[t]["accuracy"] for t in texts])
    for e in data["entries"]:
        if e["method"] == "full":
            continue
        m = out["methods"].setdefault(e["method"], {"ppl": [], "passkey": []})
        x = 100 * e["fp16_bytes"]
        if all(t in e["perplexity"] and t in full["perplexity"] for t in texts):
            m["ppl"].append((x, _mean([100 * (e["perplexity"][t] / full["perplexity"][t] - 1) for t in texts])))
        pk = e["tasks"].get("passkey", {})
        if all(t in pk for t in texts):
            m["passkey"].append((x, _mean([pk[t]["accuracy"] for t in texts])))
    for m in out["methods"].values():
        m["ppl"].sort()
        m["passkey"].sort()
    return out


def plot(data: dict[str, Any], png: Path, texts: Sequence[str] = HELD_OUT) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = series(data, texts)
    fig, (ax_p, ax_k) = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    colors = plt.get_cmap("tab10")
    for i, (name, m) in enumerate(s["methods"].items()):
        label, kind = SERIES.get(name, (name, "peer"))
        style = dict(color=colors(i % 10), label=label, marker="s" if kind == "tiered" else "o",
                     linestyle="-" if kind == "tiered" else "--", linewidth=2.2 if kind == "tiered" else 1.2)
        for ax, pts in ((ax_p, m["ppl"]), (ax_k, m["passkey"])):
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], **style)
    ax_p.axhline(0, color="black", linestyle=":", linewidth=1, label="full cache (100 %)")
    ax_p.set_yscale("symlog", linthresh=1)
    ax_p.set_ylabel(f"Δ perplexity vs full, % (mean of {len(texts)} texts)")
    ax_p.set_title("perplexity (lower is better; symlog scale)", fontsize=9)
    if s["full"]["passkey"] is not None:
        ax_k.axhline(s["full"]["passkey"], color="black", linestyle=":", linewidth=1, label="full cache (100 %)")
    ax_k.set_ylim(-0.05, 1.05)
    ax_k.set_ylabel(f"passkey accuracy (mean of {len(texts)} texts)")
    ax_k.set_title("passkey retrieval (higher is better)", fontsize=9)
    for ax in (ax_p, ax_k):
        ax.set_xlabel("KV bytes, % of the full cache's float16 bytes")
        ax.grid(True, alpha=0.3)
    handles: dict[str, Any] = {}
    for ax in (ax_p, ax_k):
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=3, fontsize=8)
    ctx = "/".join(f"{c // 1024}k" for c in data.get("contexts", [])) or "?"
    fig.suptitle(f"SmolLM2-135M-Instruct, context {ctx}: quality against KV bytes",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 0.95))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stores", type=Path, nargs="+", default=None,
                   help="suite result stores (DIR or DIR/results.json) to collect into --json first")
    p.add_argument("--json", type=Path, default=Path("docs/quality_vs_bytes.json"))
    p.add_argument("--png", type=Path, default=None, help="write the plot here (default: none unless no --stores)")
    p.add_argument("--texts", nargs="+", default=list(HELD_OUT), help="texts the means are over")
    args = p.parse_args(argv)
    if args.stores:
        data = collect(args.stores)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.json} ({len(data['entries'])} entries)", file=sys.stderr)
    else:
        data = json.loads(args.json.read_text())
    png = args.png or (None if args.stores else args.json.with_suffix(".png"))
    if png is not None:
        print(f"wrote {plot(data, png, args.texts)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
