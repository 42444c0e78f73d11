"""Load on both servers with NVIDIA's load generator (``aiperf``, in the peer venv): the
serving benchmark's workloads at equal KV bytes, a concurrency sweep, and long documents
past the KV budget.

Workloads (``runtime/serving/bench.py``'s, sent as chat requests built from the Paul
Graham essays with the model's tokenizer; greedy, ``ignore_eos`` so every answer has its
full length):
  * ``chat`` — sessions sharing one system prompt (``--system-tokens``), ``--turns`` user
    messages each; aiperf threads the live answers into the history, so a turn's prompt is
    the system prompt, every earlier turn and answer, and the new message;
  * ``docs`` — long documents (``--doc-tokens``), each asked ``--questions`` short
    questions, a document's second question after every document's first;
  * ``unique`` — the no-sharing control: single prompts of chat size sharing nothing.
``chat`` goes to ``/v1/chat/completions`` (the model's chat template); ``docs`` and
``unique`` to ``/v1/completions`` as raw text, as ``serve-bench`` feeds raw tokens (a
template would give every prompt a common system prefix).
Every run is closed loop (``aiperf --concurrency N``: N requests in flight; a chat
session's turns run one after another) against a freshly started server, one server at a
time, so that neither competes with the other for the cores nor reuses an earlier run's
cache. Each run's data is drawn with its own seed.

Equal KV bytes: vLLM ``--kv-cache-memory-bytes B`` (its whole KV cache; what
``VLLM_CPU_KVCACHE_SPACE`` sets in whole GiB) and ``tieredkv serve --kv-budget BB`` (the
device tier; the host tier is unbounded, as host memory is the cheap tier). Both count K
and V of all layers in float32, the dtype both compute in: 46,080 bytes a token for
SmolLM2-135M; the default B = 16,384 tokens (``serve-bench``'s default budget).

Per run: TTFT, ITL (aiperf's inter-token latency: a request's decode time over its gaps)
and end-to-end latency, p50 and p99 over requests; the p99 of every single gap between
streamed chunks; output tokens/s; requests done and failed; the prefix-cache hit rate from
the server's own ``/metrics`` (cached prompt tokens / prompt tokens: vLLM
``prefix_cache_hits / prefix_cache_queries``, tieredkv ``prefix_cached_tokens /
prompt_tokens``) and preemptions. Max concurrency: the highest swept concurrency whose run
had no failed request and ITL p99 <= ``--slo-itl-p99``.

``--longdoc``: documents whose KV exceeds a small budget (``--longdoc-kv-bytes``, default
4,096 tokens' worth) at a served length of 8,192: vLLM is first started at that served length
(it refuses to start when one sequence cannot fit its cache: the message is recorded), then
at the longest length its message says the cache holds, where it answers the documents 400;
tieredkv serves them at the same budget from its host tier (``--longdoc-max-num-seqs``, 8:
the device tier must be able to hold every running sequence's hot window).

    python tools/peers/load.py --workloads chat docs unique --clients 1 2 4 8 16 \\
        [--servers tieredkv vllm] [--kv-bytes 754974720] [--slo-itl-p99 1.0] [--longdoc] \\
        [--out results/peers/load-run1]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

from tieredkv.errors import ConfigError  # noqa: E402

WORKLOADS = ("chat", "docs", "unique")
SERVERS = ("tieredkv", "vllm")


@dataclass(frozen=True)
class LoadConfig:
    """The workloads' shapes (``serve-bench``'s defaults) and how many sessions a run sends."""

    sessions_per_client: int = 2
    turns: int = 3
    system_tokens: int = 512
    user_tokens: tuple[int, int] = (32, 96)
    max_new_tokens: int = 32
    doc_tokens: tuple[int, int] = (4096, 6144)
    questions: int = 2
    doc_new_tokens: int = 16


# ------------------------------------------------------------------------------ datasets
def _slice(ids: list[int], length: int, rng: random.Random) -> list[int]:
    start = rng.randrange(0, len(ids) - length)
    return ids[start:start + length]


def write_dataset(workload: str, path: Path, tokenizer, ids: list[int], *, clients: int, cfg: LoadConfig,
                  seed: int) -> dict:
    """The aiperf input file of one run (JSONL); returns its type and request count."""
    rng = random.Random(seed)
    text = lambda n: tokenizer.decode(_slice(ids, n, rng))  # noqa: E731
    sessions = cfg.sessions_per_client * clients
    lines: list[dict] = []
    if workload == "chat":
        system = text(cfg.system_tokens)
        for i in range(sessions):
            turns = [{"role": "system", "text": system}]
            turns += [{"text": text(rng.randint(*cfg.user_tokens)), "output_length": cfg.max_new_tokens}
                      for _ in range(cfg.turns)]
            lines.append({"session_id": f"c{seed}-{i}", "turns": turns})
        kind, requests, conversations = "multi_turn", sessions * cfg.turns, sessions
    elif workload == "unique":
        lines = [{"text": text(cfg.system_tokens + rng.randint(*cfg.user_tokens)), "output_length": cfg.max_new_tokens}
                 for _ in range(sessions)]
        kind, requests, conversations = "single_turn", sessions, sessions
    elif workload in ("docs", "longdoc"):
        ndocs = max(1, math.ceil(sessions / cfg.questions))
        docs = [text(rng.randint(*cfg.doc_tokens)) for _ in range(ndocs)]
        lines = [{"text": f"{docs[d]}\n\nQuestion: {text(rng.randint(12, 24))}", "output_length": cfg.doc_new_tokens}
                 for q in range(cfg.questions) for d in range(ndocs)][:sessions]
        kind, requests, conversations = "single_turn", len(lines), len(lines)
    else:
        raise ConfigError(f"unknown workload {workload!r}; expected one of {list(WORKLOADS)}")
    path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    return {"type": kind, "requests": requests, "conversations": conversations,
            "endpoint": "chat" if workload == "chat" else "completions"}


# ------------------------------------------------------------------------------ aiperf
def aiperf_command(peer: harness.Peer, url: str, model: str, dataset: Path, data: dict, *, clients: int,
                   tokenizer_dir: Path, out: Path, seed: int, timeout: float) -> list[str]:
    cmd = [str(peer.aiperf), "profile", "--model", model, "--url", url, "--endpoint-type", data["endpoint"],
           "--streaming",
           "--input-file", str(dataset), "--custom-dataset-type", data["type"],
           "--dataset-sampling-strategy", "sequential", "--concurrency", str(clients),
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
           "--tokenizer", str(tokenizer_dir), "--use-server-token-count", "--random-seed", str(seed),
           "--request-timeout-seconds", str(int(timeout)), "--output-artifact-dir", str(out),
           "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
           "--workers-max", "1", "--record-processor-service-count", "1"]
    if data["type"] == "multi_turn":
        cmd += ["--conversation-num", str(data["conversations"])]
    else:
        cmd += ["--request-count", str(data["requests"])]
    return cmd


def read_aiperf(out: Path) -> dict:
    """The figures of one run from aiperf's ``profile_export_aiperf.json`` (times in seconds)."""
    d = json.loads((out / "profile_export_aiperf.json").read_text())
    ms = lambda k, q: None if k not in d or q not in d[k] else d[k][q] / 1000  # noqa: E731
    errors = sum(e.get("count", 0) for e in d.get("error_summary") or [])
    codes = sorted({str((e.get("error_details") or {}).get("code")) for e in d.get("error_summary") or []})
    return {
        "done": int(d.get("request_count", {}).get("avg", 0)), "failed": errors, "error_codes": codes,
        "ttft_p50": ms("time_to_first_token", "p50"), "ttft_p99": ms("time_to_first_token", "p99"),
        "itl_p50": ms("inter_token_latency", "p50"), "itl_p99": ms("inter_token_latency", "p99"),
        "gap_p99": ms("inter_chunk_latency", "p99"),
        "e2e_p50": ms("request_latency", "p50"), "e2e_p99": ms("request_latency", "p99"),
        "output_tok_s": (d.get("output_token_throughput") or {}).get("avg"),
        "prompt_tokens_mean": (d.get("input_sequence_length") or {}).get("avg"),
        "duration_s": (d.get("benchmark_duration") or {}).get("avg"),
    }


def read_records(out: Path) -> dict:
    """Requests done and failed from aiperf's per-request records (``profile_export.jsonl``),
    which it writes even when every request failed and it exports no summary."""
    records = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines() if line.strip()]
    errors = [r["error"] for r in records if r.get("error")]
    return {"done": len(records) - len(errors), "failed": len(errors), "error_codes": sorted({str(e.get("code")) for e in errors}),
            "error_sample": errors[0].get("message", "")[:300] if errors else None}


# ------------------------------------------------------------------------------ /metrics
def scrape(url: str) -> dict[str, float]:
    """Prometheus counters of interest, summed over their labels."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+\d.eE]+|NaN)$", line)
        if m and m.group(3) != "NaN":
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


HIT_METRICS = {"vllm": ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:num_preemptions_total"),
               "tieredkv": ("tieredkv_prefix_cached_tokens_total", "tieredkv_prompt_tokens_total",
                            "tieredkv_preemptions_total")}


def server_figures(kind: str, before: dict, after: dict) -> dict:
    hits, queries, preempt = HIT_METRICS[kind]
    delta = lambda k: after.get(k, 0.0) - before.get(k, 0.0)  # noqa: E731
    q = delta(queries)
    return {"prefix_hit_rate": round(delta(hits) / q, 4) if q else None, "preemptions": int(delta(preempt))}


# ------------------------------------------------------------------------------ runs
@dataclass
class Context:
    peer: harness.Peer
    checkpoint: Path
    tokenizer: object
    ids: list[int]
    out: Path
    timeout: float


def start(kind: str, ctx: Context, cfg: harness.ServeConfig, logs: Path) -> harness.Server:
    if kind == "vllm":
        return harness.start_vllm(ctx.peer, ctx.checkpoint, cfg, logs)
    return harness.start_tieredkv(ctx.checkpoint, cfg, logs)


def run_one(ctx: Context, kind: str, workload: str, clients: int, serve: harness.ServeConfig, load: LoadConfig,
            seed: int) -> dict:
    """One server, one workload, one concurrency: a fresh server, aiperf, /metrics around it."""
    tag = f"{kind}-{workload}-c{clients}"
    where = ctx.out / tag
    where.mkdir(parents=True, exist_ok=True)
    data = write_dataset(workload, where / "input.jsonl", ctx.tokenizer, ctx.ids, clients=clients, cfg=load,
                         seed=seed)
    row = {"server": kind, "workload": workload, "clients": clients, "requests": data["requests"],
           "kv_bytes": serve.kv_bytes, "max_model_len": serve.max_model_len}
    t0 = time.monotonic()
    try:
        server = start(kind, ctx, serve, where)
    except harness.ServerStartError as exc:
        row.update(started=False, error=str(exc).splitlines()[0], start_error=_start_error(where / f"{kind}.log"))
        return row
    with server:
        row["kv_tokens"] = harness.vllm_kv_tokens(server) if kind == "vllm" else serve.kv_bytes // _token_bytes(ctx)
        before = scrape(server.url)
        cmd = aiperf_command(ctx.peer, server.url, serve.served_name, where / "input.jsonl", data, clients=clients,
                             tokenizer_dir=ctx.checkpoint, out=where / "aiperf", seed=seed, timeout=ctx.timeout)
        (where / "aiperf.cmd").write_text(shlex.join(cmd) + "\n")
        row["started"] = True
        limit = ctx.timeout * max(1, data["requests"]) + 600
        try:
            with open(where / "aiperf.log", "w") as log:
                status = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(where),
                                        timeout=limit).returncode
        except subprocess.TimeoutExpired:
            status = f"killed after {limit:.0f} s"
        if (where / "aiperf" / "profile_export_aiperf.json").is_file():
            row.update(read_aiperf(where / "aiperf"))
        elif (where / "aiperf" / "profile_export.jsonl").is_file():  # every request failed: no summary
            row.update(read_records(where / "aiperf"))
        else:
            row["error"] = f"aiperf exited with status {status} (log {where / 'aiperf.log'})"
        row.update(server_figures(kind, before, scrape(server.url)))
    row["wall_s"] = round(time.monotonic() - t0, 1)
    return row


def _token_bytes(ctx: Context) -> int:
    return harness.kv_bytes_per_token(ctx.checkpoint)


def _start_error(log: Path) -> str | None:
    """The line of a server log that says why it would not start (the root cause, not the
    wrapper errors after it)."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if "Error" in ln or "error:" in ln]
    cause = [ln for ln in lines if "ValueError" in ln or "error:" in ln]
    picked = cause or lines
    return picked[-1].strip()[-500:] if picked else None


def vllm_longest(log: Path) -> int | None:
    """The longest served length vLLM said its cache holds, when it refused to start."""
    m = re.search(r"estimated maximum model length is (\d+)", log.read_text(errors="replace"))
    return int(m.group(1)) if m else None


def within_slo(row: dict, slo: float) -> bool:
    return (row.get("started") and not row.get("error") and row.get("failed") == 0 and row.get("done")
            == row["requests"] and row.get("itl_p99") is not None and row["itl_p99"] <= slo)


def max_concurrency(rows: list[dict], slo: float) -> list[dict]:
    """Per server and workload: the highest concurrency within the SLO, and its output tok/s."""
    out = []
    for kind in SERVERS:
        for workload in WORKLOADS:
            mine = [r for r in rows if r["server"] == kind and r["workload"] == workload]
            if not mine:
                continue
            ok = [r for r in mine if within_slo(r, slo)]
            best = max(ok, key=lambda r: r["clients"]) if ok else None
            out.append({"server": kind, "workload": workload, "max_clients": best["clients"] if best else 0,
                        "output_tok_s": best["output_tok_s"] if best else None,
                        "swept": sorted(r["clients"] for r in mine)})
    return out


# ------------------------------------------------------------------------------ report
def _fmt(v, key: str) -> str:
    if v is None:
        return "-"
    if key.endswith(("_p50", "_p99")):
        return f"{1000 * v:.0f}"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


COLUMNS = [("server", "server"), ("workload", "workload"), ("clients", "clients"), ("done", "done"),
           ("failed", "failed"), ("ttft_p50", "TTFT p50 ms"), ("ttft_p99", "TTFT p99 ms"),
           ("itl_p50", "ITL p50 ms"), ("itl_p99", "ITL p99 ms"), ("gap_p99", "gap p99 ms"),
           ("e2e_p50", "e2e p50 ms"), ("e2e_p99", "e2e p99 ms"), ("output_tok_s", "out tok/s"),
           ("prefix_hit_rate", "prefix hits"), ("preemptions", "preempt"), ("wall_s", "wall s")]


def markdown(rows: list[dict], summary: list[dict], slo: float, header: str) -> str:
    md = [header, "", "| " + " | ".join(t for _, t in COLUMNS) + " |",
          "|" + "|".join("---" if i < 2 else "---:" for i in range(len(COLUMNS))) + "|"]
    for r in rows:
        if not r.get("started", True) or r.get("error"):
            md.append(f"| {r['server']} | {r['workload']} | {r['clients']} | " + f"{r.get('error')} |")
            continue
        md.append("| " + " | ".join(_fmt(r.get(k), k) for k, _ in COLUMNS) + " |")
    if summary:
        md += ["", f"Max concurrency with no failed request and ITL p99 <= {slo:g} s:", "",
               "| server | workload | max clients | out tok/s there | swept |", "|---|---|---:|---:|---|"]
        md += [f"| {s['server']} | {s['workload']} | {s['max_clients']} | {_fmt(s['output_tok_s'], '')} | "
               f"{' '.join(map(str, s['swept']))} |" for s in summary]
    return "\n".join(md)


def longdoc(ctx: Context, servers: list[str], serve: harness.ServeConfig, load: LoadConfig, clients: int,
            seed: int) -> list[dict]:
    """Documents past a small KV budget: vLLM at the same served length (refuses to start),
    then at the longest it says its cache holds; tieredkv at the same served length."""
    rows = []
    for kind in servers:
        row = run_one(ctx, kind, "longdoc", clients, serve, load, seed)
        rows.append(row)
        if kind == "vllm" and not row.get("started"):
            longest = vllm_longest(ctx.out / f"{kind}-longdoc-c{clients}" / "vllm.log")
            if longest is None:
                continue
            clipped = replace(serve, max_model_len=longest,
                              max_num_batched_tokens=min(serve.max_num_batched_tokens, longest))
            rows.append(run_one(replace(ctx, out=ctx.out / "clipped"), kind, "longdoc", clients, clipped, load,
                                seed))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    ap.add_argument("--workloads", nargs="*", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="concurrency sweep")
    ap.add_argument("--kv-bytes", type=int, default=harness.ServeConfig.kv_bytes, help="KV bytes of both servers")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1, help="compute threads of each server")
    ap.add_argument("--tieredkv-args", default=" ".join(harness.ServeConfig.tieredkv_args),
                    help="the tiered cache's `tieredkv serve` flags (one string)")
    ap.add_argument("--tieredkv-cache", choices=["tiered", "paged"], default="tiered",
                    help="tieredkv on its tiered cache (--kv-budget) or its plain paged cache of the same bytes")
    ap.add_argument("--sessions-per-client", type=int, default=LoadConfig.sessions_per_client)
    ap.add_argument("--turns", type=int, default=LoadConfig.turns)
    ap.add_argument("--system-tokens", type=int, default=LoadConfig.system_tokens)
    ap.add_argument("--max-new-tokens", type=int, default=LoadConfig.max_new_tokens)
    ap.add_argument("--doc-tokens", type=int, nargs=2, default=list(LoadConfig.doc_tokens))
    ap.add_argument("--slo-itl-p99", type=float, default=1.0, help="P99 ITL SLO in seconds (this CPU)")
    ap.add_argument("--longdoc", action="store_true", help="also the long-document row (below)")
    ap.add_argument("--longdoc-kv-bytes", type=int, default=4096 * 46080)
    ap.add_argument("--longdoc-tokens", type=int, nargs=2, default=[6000, 7000])
    ap.add_argument("--longdoc-docs", type=int, default=4)
    ap.add_argument("--longdoc-clients", type=int, default=2)
    ap.add_argument("--longdoc-max-num-seqs", type=int, default=8,
                    help="the tiered budget holds every running sequence's hot window: 8 fit 4,096 tokens")
    ap.add_argument("--timeout", type=float, default=900.0, help="per request, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/peers/load"))
    args = ap.parse_args(argv)
    from tieredkv.models.tokenizer import Tokenizer
    from tieredkv.runtime.eval.data import pg_essays_text

    root = harness.peers_dir()
    try:
        peer = harness.find_peer()
    except harness.PeerUnavailable as exc:
        print(f"SKIP: {exc}", file=sys.stderr)
        return harness.EXIT_SKIP
    checkpoint = harness.write_checkpoint(root)
    tok = Tokenizer.from_hf_dir(checkpoint)
    args.out = args.out.resolve()  # aiperf runs in each run's folder: its paths must not be relative
    harness.interrupt_on_signals()  # killed, it stops the server of the run in progress
    ctx = Context(peer, checkpoint, tok, tok.encode(pg_essays_text(), add_bos=False), args.out, args.timeout)
    args.out.mkdir(parents=True, exist_ok=True)
    serve = harness.ServeConfig(kv_bytes=args.kv_bytes, max_model_len=args.max_model_len,
                                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                threads=args.threads, tieredkv_args=tuple(shlex.split(args.tieredkv_args)),
                                tieredkv_cache=args.tieredkv_cache)
    load = LoadConfig(sessions_per_client=args.sessions_per_client, turns=args.turns,
                      system_tokens=args.system_tokens, max_new_tokens=args.max_new_tokens,
                      doc_tokens=tuple(args.doc_tokens))
    header = (f"# tieredkv vs vLLM under aiperf — {date.today().isoformat()}, {args.threads} compute thread(s) each, "
              f"KV {args.kv_bytes} bytes ({args.kv_bytes // _token_bytes(ctx)} tokens) each, served length "
              f"{args.max_model_len}, max {args.max_num_seqs} sequences, {args.max_num_batched_tokens} tokens a step")
    report = {"date": date.today().isoformat(), "argv": argv if argv is not None else sys.argv[1:],
              "serve": asdict(serve), "load": asdict(load), "rows": [], "longdoc": []}

    def save() -> None:
        summary = max_concurrency(report["rows"], args.slo_itl_p99)
        report["max_concurrency"] = summary
        md = markdown(report["rows"], summary, args.slo_itl_p99, header)
        if report["longdoc"]:
            md += "\n\n" + markdown(report["longdoc"], [], args.slo_itl_p99,
                                    f"## Long documents ({args.longdoc_tokens[0]}-{args.longdoc_tokens[1]} tokens) "
                                    f"past a KV budget of {args.longdoc_kv_bytes} bytes")
            md += "\n" + "\n".join(f"- {r['server']} (served length {r['max_model_len']}): did not start: "
                                   f"{r.get('start_error')}" for r in report["longdoc"] if not r.get("started"))
            md += "\n" + "\n".join(f"- {r['server']} (served length {r['max_model_len']}): {r['failed']} of "
                                   f"{r['done'] + r['failed']} requests failed, HTTP {', '.join(r['error_codes'])}: {r['error_sample']}"
                                   for r in report["longdoc"] if r.get("error_sample"))
        (args.out / "results.json").write_text(json.dumps(report, indent=1, default=str))
        (args.out / "table.md").write_text(md + "\n")

    for workload in args.workloads:
        for i, clients in enumerate(args.clients):
            seed = args.seed * 1000 + WORKLOADS.index(workload) * 100 + i
            for kind in args.servers:
                harness._log(f"{kind} / {workload} / {clients} clients")
                report["rows"].append(run_one(ctx, kind, workload, clients, serve, load, seed))
                save()
    if args.longdoc:
        small = replace(serve, kv_bytes=args.longdoc_kv_bytes, max_num_seqs=args.longdoc_max_num_seqs)
        ld = replace(load, doc_tokens=tuple(args.longdoc_tokens), questions=1,
                     sessions_per_client=math.ceil(args.longdoc_docs / args.longdoc_clients))
        report["longdoc"] = longdoc(replace(ctx, out=args.out / "longdoc"), args.servers, small, ld,
                                    args.longdoc_clients, args.seed)
        save()
    print((args.out / "table.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
