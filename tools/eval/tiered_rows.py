"""tieredkv's tiered cache as rows of the kvpress comparison (``--rows-from tiered_rows:rows``).

    python tools/eval/kvpress_compare.py --no-tieredkv-rows --presses --rows-from tiered_rows:rows ...

Budget b of a row = the device-resident KV budget as a fraction of the full cache of the
whole sequence (context + what is scored after it), held for the entire run; the
attention budget defaults to what fits in it. kvpress keeps b of the *context* and then
grows by every decoded token, so on the perplexity protocol (3/4 context, 1/4 scored)
it holds between 0.75 b and 0.75 b + 0.25 of the full cache; on passkey the two
definitions coincide (the continuation is a few tokens).

In exact mode the pages a step attends to depend on the scores only, never on
residency, so every replacement policy gives the same output (the test suite checks
this); the policy changes only what moves between tiers. Exact mode is therefore one
row; masked mode, where residency decides what is attended, is one row per policy.
"""

from __future__ import annotations

import os

from kvpress_compare import Row

from tieredkv.runtime.eval.harness import tiered_method
from tieredkv.runtime.tiered.config import TieredKVConfig

MASKED_POLICIES = ("lru", "lfu", "lfu-importance", "h2o", "streaming")
#: (codec, warm_fraction) of the warm rows; the 0.75 rows are named without the fraction
WARM_ROWS = (("int4", 0.75), ("fp8-r2", 0.75), ("int6-r2", 0.75), ("int4-g16", 0.75), ("int4", 1.0))


def _row(name: str, **cfg) -> Row:
    def factory(model, budget: float):
        config = TieredKVConfig(device_budget=f"{100 * budget:g}%", **{"warm_codec": "off", **cfg})  # rows name their warm tier
        # keep_decoded_warm: the CPU evaluation aid, each warm page decoded once; identical numerics
        return tiered_method(model, config, name=name, keep_decoded_warm=True)

    return Row(name, factory, backend="tieredkv")


def rows() -> list[Row]:
    """Exact mode (policy-independent quality) plus masked mode for every live policy.
    ``TIEREDKV_ROWS_FILTER`` (comma-separated names) keeps a subset."""
    out = [_row("tieredkv-exact", mode="exact", policy="lfu-importance")]
    out += [_row(f"tieredkv-masked-{p}", mode="masked", policy=p) for p in MASKED_POLICIES]
    # the same device bytes with a warm (compressed) share: more pages resident and attended.
    # Pages stored in float16 (the deployment dtype; the budget is a fraction of the float16 cache)
    out += [_row(f"tieredkv-exact-warm-{c}" + ("" if f == 0.75 else f"-f{f:g}"), mode="exact",
                 policy="lfu-importance", kv_dtype="float16", warm_codec=c, warm_fraction=f) for c, f in WARM_ROWS]
    # per-head-rank selection (selection_aggregate = "head-rank", PyTorch backend only)
    out += [_row("tieredkv-exact-headrank", mode="exact", policy="lfu-importance", selection_aggregate="head-rank"),
            _row("tieredkv-exact-warm-int4-headrank", mode="exact", policy="lfu-importance", kv_dtype="float16",
                 warm_codec="int4", warm_fraction=0.75, selection_aggregate="head-rank")]
    keep = os.environ.get("TIEREDKV_ROWS_FILTER")
    if keep:
        names = set(keep.split(","))
        out = [r for r in out if r.name in names]
    return out
