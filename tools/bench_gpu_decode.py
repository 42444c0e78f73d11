"""End-to-end decode on a device: the full (paged) cache against the tiered cache at a device
budget, same prompt, greedy, the PyTorch backend with ``device=`` (tools/gpu_check.sh runs it
on a lent GPU).

    python tools/bench_gpu_decode.py [--device cuda] [--model M | --preset smollm2-135m]
        [--contexts 2048 8000] [--new-tokens 64] [--budget 25%] [--dtype float16] [--out DIR]

Per context: prefill the prompt (one sequence; random token ids from a fixed seed: the
machine a GPU is lent on has no network for the text corpora), then greedy-decode
``--new-tokens`` tokens with each cache — ``full`` (PagedKVCache); ``tiered-<budget>-attend-all`` (residency limited,
every page attended, misses fetched: its tokens must equal the full cache's); the default
``tiered-<budget>`` (attention budget = device budget) and ``tiered-<budget>-masked`` — timing
prefill and decode with the device synchronized. Reports decode tok/s, the tokens' agreement
with the full cache, peak device memory, and the tiered cache's misses and host-to-device
bytes per decode step; writes bench_gpu_decode.json and .md under --out. Exit 1 when the attend-all
run's tokens differ from the full cache's.

``--model`` omitted: the default model where its checkpoint is already in the model cache (no
download is tried), else the ``smollm2-135m`` shape with seeded random weights — the same
arithmetic and bytes, so the same speed; the CPU runs (docs/benchmarks.md) measure quality.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from tieredkv.models.cache import KVCache
from tieredkv.models.config import preset
from tieredkv.models.llama import Llama, decode_one_token, init_random_weights, prefill
from tieredkv.runtime.llm import parse_dtype, resolve_device
from tieredkv.runtime.paged import PagedKVCache
from tieredkv.runtime.tiered.cache import TieredKVCache
from tieredkv.runtime.tiered.config import TieredKVConfig


def load_model(args: argparse.Namespace, log) -> tuple[Llama, str]:
    dtype = parse_dtype(args.dtype)
    if args.preset is None:
        from tieredkv.models.hub import DEFAULT_MODEL, MODELS, cache_dir
        from tieredkv.models.loading import load_checkpoint

        path = Path(args.model) if args.model else cache_dir() / "models" / MODELS[DEFAULT_MODEL].filename
        if path.exists():
            return load_checkpoint(path, dtype=dtype).model, str(path.name)
        if args.model:
            raise SystemExit(f"--model {args.model}: no such file")
        log(f"the default model's checkpoint is not here ({path}): the smollm2-135m shape with random weights")
    name = args.preset or "smollm2-135m"
    model = init_random_weights(Llama(preset(name)), seed=0).to(dtype)
    return model, f"preset:{name} (random weights)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one(model: Llama, cache: KVCache, prompt: torch.Tensor, new_tokens: int, device: torch.device) -> dict:
    """Prefill + greedy decode with ``cache``; times and tokens."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sid = cache.add_sequence()
    sync(device)
    t0 = time.perf_counter()
    logits = prefill(model, cache, sid, prompt, chunk_size=512)
    token = int(torch.argmax(logits))
    sync(device)
    t1 = time.perf_counter()
    metrics = getattr(cache, "metrics", None)
    before = None if metrics is None else (metrics.misses, metrics.bytes_h2d, metrics.fetched_pages)
    tokens = [token]
    pos = len(prompt)
    for _ in range(new_tokens - 1):
        logits = decode_one_token(model, cache, [sid], torch.tensor([token]), torch.tensor([pos]))
        token = int(torch.argmax(logits[0]))  # the host reads the token: one sync per step, as a server does
        tokens.append(token)
        pos += 1
    sync(device)
    t2 = time.perf_counter()
    out = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_tok_s": (new_tokens - 1) / max(t2 - t1, 1e-9),
           "tokens": tokens, "kv_bytes": cache.kv_bytes()}
    if device.type == "cuda":
        out["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
    if metrics is not None:  # the decode steps' share (prefill streams every page once)
        steps = max(1, new_tokens - 1)
        out.update(misses=metrics.misses - before[0], h2d_bytes_per_step=(metrics.bytes_h2d - before[1]) / steps,
                   fetched_pages=metrics.fetched_pages - before[2])
    cache.free_sequence(sid)
    cache.close()
    return out


def caches(model: Llama, budget: str, context: int) -> dict:
    """The runs of one context: name -> (make the cache, its tokens must equal the full cache's)."""
    spec = model.kv_spec()

    def tiered(**kw):
        return lambda: TieredKVCache(spec, TieredKVConfig(device_budget=budget, **kw), full_tokens=context)

    return {
        "full": (lambda: PagedKVCache(spec), True),
        # residency limited, every page attended (misses fetched): exact, the full cache's tokens
        f"tiered-{budget}-attend-all": (tiered(attention_budget="100%", warm_codec="off"), True),
        f"tiered-{budget}": (tiered(), False),  # the default: attend what fits on the device (warm int4)
        f"tiered-{budget}-masked": (tiered(mode="masked"), False),
    }


def report(rows: list[dict], meta: dict) -> str:
    lines = [f"# End-to-end decode on {meta['device_name']}", "",
             f"{meta['date']}, model {meta['model']}, dtype {meta['dtype']}, torch {meta['torch']}, "
             f"`{meta['command']}`", "",
             "| context | cache | prefill s | decode tok/s | tokens = full | peak device MiB | misses | h2d KiB/step |",
             "|---:|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        peak = f"{r['peak_device_bytes'] / 2**20:.0f}" if "peak_device_bytes" in r else "—"
        h2d = f"{r['h2d_bytes_per_step'] / 1024:.1f}" if "h2d_bytes_per_step" in r else "—"
        lines.append(f"| {r['context']} | {r['cache']} | {r['prefill_s']:.2f} | {r['decode_tok_s']:.1f} | "
                     f"{r['agreement']} | {peak} | {r.get('misses', '—')} | {h2d} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=None, help="a checkpoint path (default: the default model when present)")
    ap.add_argument("--preset", default=None, help="a shape preset with random weights (default smollm2-135m "
                                                   "when no checkpoint is here)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8000])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--budget", default="25%", help="device budget of the tiered runs (default 25%%)")
    ap.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--out", default="results/gpu_decode")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(f"[bench_gpu_decode] {msg}", file=sys.stderr, flush=True)

    device = resolve_device(args.device)
    model, model_name = load_model(args, log)
    model = model.to(device).eval()
    ctx_limit = model.config.max_position_embeddings
    gen = torch.Generator().manual_seed(0)
    rows, failed = [], False
    for context in args.contexts:
        if context + args.new_tokens > ctx_limit:
            raise SystemExit(f"--contexts {context} + --new-tokens {args.new_tokens} is over the model's {ctx_limit}")
        prompt = torch.randint(100, model.config.vocab_size, (context,), generator=gen)
        ref = None
        for name, (make, exact) in caches(model, args.budget, context + args.new_tokens).items():
            log(f"context {context}: {name}")
            r = run_one(model, make(), prompt, args.new_tokens, device)
            if ref is None:
                ref = r["tokens"]
            same = sum(a == b for a, b in zip(r["tokens"], ref))
            r.update(context=context, cache=name, agreement=f"{same}/{len(ref)}")
            if exact and r["tokens"] != ref:
                failed = True
                log(f"MISMATCH: {name} at context {context}: {same}/{len(ref)} tokens equal the full cache's")
            rows.append(r)
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "model": model_name,
            "dtype": args.dtype, "torch": torch.__version__, "host": platform.node(),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "command": "python tools/bench_gpu_decode.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_gpu_decode.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    text = report(rows, meta)
    (out / "bench_gpu_decode.md").write_text(text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
