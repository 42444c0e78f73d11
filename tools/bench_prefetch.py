"""Access logs, the access predictors and the prefetcher, measured (docs/prefetch.md).

    python tools/bench_prefetch.py record --texts as-you-like-it licenses --contexts 2048 \
        --attention-budgets 0.25 0.125 0.0625 --out results/prefetch/logs
    python tools/bench_prefetch.py eval --logs results/prefetch/logs --out results/prefetch

record: SmolLM2 access logs (exact mode, the device budget unlimited: in exact mode which
pages a step needs does not depend on residency, so one log serves every device budget).
Kinds: ``window`` — a window of a text, all but the last ``--decode-steps`` tokens as context,
the rest teacher-forced one token per step (the perplexity protocol); ``generate`` — the same
context, then the model's own greedy tokens (free generation: the fine-tuning logs of the
GRU); ``digits`` — a multi-key magic-number prompt (numbers hidden in the text), then a
teacher-forced continuation dense in 5- to 7-digit numbers (the design note's augmentation:
its predictor mispredicted numbers). Every log records ``spec`` (the cross-layer predictor's
input) and the time that took.

eval: replays every log through the TierManager at each device budget and attention budget
it serves (device budget b with attention budget = b and = b / 2) for every predictor
(none, the oracle, last, vote, recency, quest-next-layer, gru), and reports prefetch recall
and precision, stall bytes per step (needed pages not resident when the step began, fetched
on the critical path in exact mode) and their share of demand paging's (no predictor), bytes
moved, wasted prefetch bytes, predictor time per step (CPU, measured; the cross-layer
predictor's scoring included) and the modelled H200 step time (``step_time``), with fp16
pages (the deployment dtype) for every byte count.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

KINDS = ("window", "generate", "digits")


def _projection(preset: str = "llama2-70b", context: int = 32768, page_size: int = 16) -> dict:
    """The shape the measured page shares are projected onto (fp16 pages and weights)."""
    from tieredkv.models.config import PRESETS
    from tieredkv.runtime.tiered.step_time import weight_bytes

    cfg = PRESETS[preset]
    pages = cfg.num_layers * -(-context // page_size)
    return {"name": f"{preset} @ {context // 1024}k", "pages": pages, "weight_bytes": weight_bytes(cfg),
            "kv_bytes": pages * page_size * cfg.kv_bytes_per_token(2) // cfg.num_layers}


PROJECT = _projection()
PREDICTOR_ORDER = ("none", "oracle", "last", "vote", "recency", "quest-next-layer", "gru")


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _digit_continuation(rng: random.Random, keys: list[str]) -> str:
    lines = []
    for _ in range(400):
        lines.append(f"The special magic number for {rng.choice(keys)} is {rng.randrange(10**4, 10**7)}; "
                     f"the code is {rng.randrange(10**5, 10**6)}.")
    return " ".join(lines)


def cmd_record(args: argparse.Namespace) -> int:
    from tieredkv.models.hub import resolve_model
    from tieredkv.models.loading import load_checkpoint
    from tieredkv.runtime.eval.harness import CacheMethod
    from tieredkv.runtime.eval.tasks import PLAIN, task_prompts
    from tieredkv.runtime.eval.texts import suite_text
    from tieredkv.runtime.tiered.cache import TieredKVCache
    from tieredkv.runtime.tiered.config import TieredKVConfig
    from tieredkv.runtime.tiered.trace import TraceRecorder

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_checkpoint(resolve_model(args.model, log=_log))
    model, tok = loaded.model, loaded.tokenizer
    spec = model.kv_spec()
    weight_bytes = 2 * sum(p.numel() for p in model.parameters())  # fp16 weights
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for text in args.texts:
        ids = tok.encode(suite_text(text, log=_log), add_bos=False)
        for context in args.contexts:
            for w in range(args.windows):
                offset = (w + 1) * len(ids) // (args.windows + 1) if args.windows > 1 else len(ids) // 3
                window = ids[offset : offset + context]
                if args.kind == "digits":
                    prompt = next(task_prompts("multikey", tok, ids, context=context - args.decode_steps, trials=1,
                                               seed=w, frame=PLAIN))
                    rng = random.Random(f"digits/{text}/{context}/{w}")
                    more = tok.encode(_digit_continuation(rng, ["alpha", "bravo", "delta", "kilo"]), add_bos=False)
                    ctx_ids, cont = prompt.context, (prompt.question + prompt.answer + more)[: args.decode_steps]
                else:
                    ctx_ids, cont = window[: context - args.decode_steps], window[context - args.decode_steps :]
                for ab in args.attention_budgets:
                    name = f"{args.kind}_{text}_c{context}_a{ab:g}_w{w}.pt"
                    if (out / name).exists():
                        _log(f"{name}: exists, skipped")
                        continue
                    cfg = TieredKVConfig(attention_budget=f"{100 * ab:g}%", mode="exact", warm_codec="off")
                    meta = {"kind": args.kind, "text": text, "context": context, "attention_budget": ab, "window": w,
                            "model": str(loaded.path) if hasattr(loaded, "path") else "default",
                            "weight_bytes_fp16": weight_bytes, "token_bytes_per_layer_fp16":
                            2 * spec.num_kv_heads * spec.head_dim * 2, "decode_steps": len(cont)}
                    rec = TraceRecorder(speculate=True, meta=meta)
                    caches = []

                    def factory(total, rec=rec, cfg=cfg):
                        caches.append(TieredKVCache(spec, cfg, full_tokens=total, recorder=rec))
                        return caches[-1]

                    t_start = time.perf_counter()
                    method = CacheMethod(model, factory, teacher_forcing_chunk=1, prefill_chunk=args.prefill_chunk)
                    session = method.open(ctx_ids, total_tokens=len(ctx_ids) + len(cont))
                    if args.kind == "generate":
                        session.greedy([], max_new_tokens=len(cont))
                    else:
                        session.logprobs(cont)
                    session.close()
                    m = caches[-1].metrics
                    rec.trace.meta["spec_seconds_per_decode_step"] = m.predictor_seconds / max(1, m.decode_steps)
                    rec.trace.save(out / name)
                    _log(f"{name}: {rec.trace.decode_steps} decode steps in {time.perf_counter() - t_start:.0f}s")
    return 0


def _configs(ab: float) -> list[tuple[float, float]]:
    """(device budget, attention budget) pairs a log recorded at attention budget ``ab`` serves:
    attention = device, and attention = device / 2 (for the issue's 25 % and 12.5 %)."""
    out = []
    for device in (0.25, 0.125):
        for ratio in (1.0, 0.5):
            if abs(device * ratio - ab) < 1e-9:
                out.append((device, ratio))
    return out


def _log_shape(trace) -> dict:
    """Per decode step: attended pages (needed + T0, all layers) and every page (all layers)."""
    attended, total = [], []
    for s in trace.steps:
        if s.decode:
            t0 = s.t0 if s.t0 is not None else torch.zeros(s.needed.shape[1], dtype=torch.bool)
            attended.append(int((s.needed | t0.unsqueeze(0)).sum()))
            total.append(s.needed.numel())
    return {"attended": statistics.mean(attended), "pages": statistics.mean(total)}


def cmd_eval(args: argparse.Namespace) -> int:
    from tieredkv.runtime.tiered.config import TieredKVConfig
    from tieredkv.runtime.tiered.step_time import get_gpu, step_time
    from tieredkv.runtime.tiered.trace import AccessTrace, replay

    gpu = get_gpu(args.gpu)
    logs = sorted(Path(args.logs).glob("*.pt"))
    logs = [p for p in logs if any(p.name.startswith(k + "_") for k in args.kinds)]
    if args.texts:
        logs = [p for p in logs if any(f"_{t}_" in p.name for t in args.texts)]
    if not logs:
        _log(f"no logs of kinds {args.kinds} under {args.logs}")
        return 1
    rows = []
    for path in logs:
        trace = AccessTrace.load(path)
        meta = trace.meta
        tb = int(meta["token_bytes_per_layer_fp16"])
        page_bytes = tb * trace.page_size
        shape = _log_shape(trace)
        full_tokens = meta["context"]
        for device, ratio in _configs(float(meta["attention_budget"])):
            cfg = TieredKVConfig(device_budget=f"{100 * device:g}%", attention_budget=f"{100 * device * ratio:g}%",
                                 mode="exact", warm_codec="off")
            base = None
            for pred in args.predictors:
                t_start = time.perf_counter()
                m = replay(trace, cfg, token_bytes_per_layer=tb, dtype=torch.float16, full_tokens=full_tokens,
                           predictor=None if pred == "none" else pred, prefetch_distance=args.distance)
                steps = max(1, m.decode_steps)
                pred_s = 0.0 if pred == "oracle" else m.predictor_seconds / steps  # the ceiling reads the log: no cost
                if pred == "quest-next-layer":
                    pred_s += float(meta.get("spec_seconds_per_decode_step", 0.0))  # its scoring, paid live
                stall = m.misses * page_bytes / steps
                prefetch = m.bytes_prefetch / steps
                st = step_time(gpu, weight_bytes=meta["weight_bytes_fp16"], kv_read_bytes=shape["attended"] * page_bytes,
                               stall_bytes=stall, prefetch_bytes=prefetch, predictor_s=pred_s)
                # the same shares of the pages, at the projection's shape and context
                scale = PROJECT["pages"] / shape["pages"]
                pst = step_time(gpu, weight_bytes=PROJECT["weight_bytes"],
                                kv_read_bytes=shape["attended"] / shape["pages"] * PROJECT["kv_bytes"],
                                stall_bytes=stall / page_bytes / shape["pages"] * PROJECT["kv_bytes"],
                                prefetch_bytes=prefetch / page_bytes / shape["pages"] * PROJECT["kv_bytes"],
                                predictor_s=pred_s * scale)
                row = {"log": path.name, "kind": meta["kind"], "text": meta["text"], "context": meta["context"],
                       "device": device, "attention": device * ratio, "predictor": pred, "decode_steps": m.decode_steps,
                       "hits": m.hits, "misses": m.misses, "prefetched": m.prefetched_pages,
                       "prefetch_hits": m.prefetch_hits, "wasted": m.prefetch_wasted,
                       "recall": m.prefetch_recall, "precision": m.prefetch_precision if m.prefetched_pages else None,
                       "stall_bytes_per_step": stall, "h2d_bytes_per_step": m.bytes_h2d / steps,
                       "d2h_bytes_per_step": m.bytes_d2h / steps, "wasted_bytes_per_step": m.prefetch_wasted * page_bytes / steps,
                       "predictor_ms_per_step": 1000 * pred_s, "step_us": 1e6 * st.total_s,
                       "projected_step_ms": 1e3 * pst.total_s,
                       "replay_seconds": time.perf_counter() - t_start}
                if pred == "none":
                    base = row
                    full = step_time(gpu, weight_bytes=meta["weight_bytes_fp16"], kv_read_bytes=shape["pages"] * page_bytes)
                    row["full_cache_step_us"] = 1e6 * full.total_s
                    row["projected_full_ms"] = 1e3 * step_time(gpu, weight_bytes=PROJECT["weight_bytes"],
                                                               kv_read_bytes=PROJECT["kv_bytes"]).total_s
                row["stall_share"] = stall / base["stall_bytes_per_step"] if base and base["stall_bytes_per_step"] else None
                row["full_cache_step_us"] = base["full_cache_step_us"]
                row["projected_full_ms"] = base["projected_full_ms"]
                rows.append(row)
                _log(f"{path.name} device {device:g} attention {device * ratio:g} {pred}: recall {m.prefetch_recall:.3f} "
                     f"precision {row['precision'] if row['precision'] is None else round(row['precision'], 3)} "
                     f"stall share {row['stall_share']} step {row['step_us']:.1f}us")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = " ".join(["python"] + sys.argv)
    (out / "prefetch.json").write_text(json.dumps({"command": cmd, "gpu": gpu.describe(), "rows": rows}, indent=1))
    md = table(rows, gpu.describe(), cmd)
    (out / "prefetch.md").write_text(md)
    print(md)
    return 0


def table(rows: list[dict], gpu: str, cmd: str) -> str:
    """Means over logs per (device, attention, predictor)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["device"], r["attention"], r["predictor"]), []).append(r)
    mean = lambda rs, k: statistics.mean(r[k] for r in rs if r[k] is not None) if any(r[k] is not None for r in rs) else None  # noqa: E731
    fmt = lambda v, f: "—" if v is None else format(v, f)  # noqa: E731
    logs = sorted({r["log"] for r in rows})
    lines = [f"{len(logs)} log(s): {', '.join(sorted({r['text'] for r in rows}))}; kinds "
             f"{', '.join(sorted({r['kind'] for r in rows}))}; contexts {sorted({r['context'] for r in rows})}; "
             f"modelled on {gpu}, fp16 pages; `{cmd}`", "",
             f"The last two columns project the same page shares onto {PROJECT['name']} (its weights and KV bytes; "
             "the predictor's time scaled by layers x pages): an estimate, not a measurement.", "",
             "| device | attention | predictor | recall | precision | stall KiB/step | stall / demand paging | "
             "wasted KiB/step | h2d KiB/step | predictor ms/step (CPU) | modelled step µs (full cache) | "
             f"{PROJECT['name']} step ms (full cache) |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    order = {p: i for i, p in enumerate(PREDICTOR_ORDER)}
    for (d, a, p), rs in sorted(groups.items(), key=lambda kv: (-kv[0][0], -kv[0][1], order.get(kv[0][2], 99))):
        share = mean(rs, "stall_share")
        lines.append(f"| {100 * d:g}% | {100 * a:g}% | {p} | {fmt(mean(rs, 'recall'), '.3f')} | "
                     f"{fmt(mean(rs, 'precision'), '.3f')} | {mean(rs, 'stall_bytes_per_step') / 1024:.1f} | "
                     f"{fmt(None if share is None else 100 * share, '.1f')}{'' if share is None else ' %'} | "
                     f"{mean(rs, 'wasted_bytes_per_step') / 1024:.1f} | {mean(rs, 'h2d_bytes_per_step') / 1024:.1f} | "
                     f"{mean(rs, 'predictor_ms_per_step'):.2f} | {mean(rs, 'step_us'):.1f} "
                     f"({mean(rs, 'full_cache_step_us'):.1f}) | {mean(rs, 'projected_step_ms'):.2f} "
                     f"({mean(rs, 'projected_full_ms'):.2f}) |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record SmolLM2 access logs")
    r.add_argument("--model", default=None)
    r.add_argument("--texts", nargs="+", default=["as-you-like-it"])
    r.add_argument("--contexts", type=int, nargs="+", default=[2048])
    r.add_argument("--attention-budgets", type=float, nargs="+", default=[0.25, 0.125, 0.0625])
    r.add_argument("--decode-steps", type=int, default=256)
    r.add_argument("--windows", type=int, default=1)
    r.add_argument("--kind", choices=KINDS, default="window")
    r.add_argument("--prefill-chunk", type=int, default=64,
                   help="tokens per prefill step (small enough for the smallest device budget replayed)")
    r.add_argument("--threads", type=int, default=0)
    r.add_argument("--out", default="results/prefetch/logs")
    e = sub.add_parser("eval", help="replay the logs under every predictor")
    e.add_argument("--logs", default="results/prefetch/logs")
    e.add_argument("--kinds", nargs="+", default=["window"])
    e.add_argument("--texts", nargs="+", default=None)
    e.add_argument("--predictors", nargs="+", default=list(PREDICTOR_ORDER))
    e.add_argument("--distance", type=int, default=2)
    e.add_argument("--gpu", default="h200")
    e.add_argument("--out", default="results/prefetch")
    args = ap.parse_args()
    return {"record": cmd_record, "eval": cmd_eval}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
