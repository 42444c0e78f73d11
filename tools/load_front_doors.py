"""Load test of the front doors, over HTTP against real servers started here.

Two experiments, on the serving benchmark's shared-system-prompt workload (``chat``:
sessions that share a system prompt, several turns each, a turn's prompt holding the
earlier turns and answers; ``runtime/serving/bench.py``), closed loop at each
concurrency (that many clients, each running its sessions' turns one after another):

* ``doors``: one ``tieredkv serve`` (OpenAI ``/v1/completions``, streaming) and one
  ``tritonserver`` with the ``tieredkv triton-repo`` model (``generate_stream``), same
  engine settings;
* ``replicas``: two ``tieredkv serve`` replicas behind a round-robin client (no session
  affinity: a conversation's turns land on either replica), sharing a Redis remote KV
  tier, against the same two replicas without it.

Per request: TTFT (request sent → first streamed token), inter-token latency (gaps between
streamed tokens), end to end; throughput is output tokens per wall second of the run. The
servers' own ``/metrics`` give the prefix and remote-tier hits. Writes JSON and a markdown
table.

    python tools/load_front_doors.py --experiments doors replicas --concurrency 1 4 \\
        --sessions 8 --turns 2 --kv-budget 25% --out results/front-doors

Servers bind 127.0.0.1 on free ports and are stopped by pid at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ servers
class Proc:
    """A server subprocess with its log in a file; ``stop()`` by pid (SIGTERM, then SIGKILL)."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None) -> None:
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while time.monotonic() < deadline:
            m = rx.search(self.log_path.read_text(errors="replace"))
            if m:
                return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"server did not come up (exit {self.proc.poll()}); log {self.log_path}:\n"
                           + self.log_path.read_text(errors="replace")[-3000:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def serve_args(args: argparse.Namespace, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "tieredkv.cli", "serve", "--port", "0", "--log-level", "warning",
           "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs)]
    if args.model:
        cmd += ["--model", args.model]
    if args.kv_budget:
        cmd += ["--kv-budget", args.kv_budget]
    return cmd + list(extra)


def start_openai(args, workdir: Path, name: str, *extra: str) -> tuple[Proc, str]:
    proc = Proc(serve_args(args, *extra), workdir / f"{name}.log")
    m = proc.wait_for(r"listening on (http://127\.0\.0\.1:\d+)", args.start_timeout)
    return proc, m.group(1)


def start_redis(workdir: Path) -> tuple[Proc, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    from tieredkv.runtime.serving.triton.server import free_ports

    port = free_ports(1)[0]
    proc = Proc([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(workdir)], workdir / "redis.log")
    proc.wait_for(r"Ready to accept connections", 30)
    return proc, f"redis://127.0.0.1:{port}/0"


def start_triton(args, workdir: Path) -> tuple[object, str]:
    from tieredkv.runtime.serving.deploy import EngineArgs
    from tieredkv.runtime.serving.triton.repo import write_repository
    from tieredkv.runtime.serving.triton.server import TritonServer

    kv = {"device_budget": args.kv_budget} if args.kv_budget else None
    eargs = EngineArgs(model=args.model, kv=kv, scheduler={"max_model_len": args.max_model_len,
                                                            "max_num_seqs": args.max_num_seqs})
    repo = write_repository(workdir / "triton-repo", eargs, model_name="tieredkv")
    server = TritonServer(repo, log_file=workdir / "triton.log", startup_timeout=args.start_timeout)
    server.start()
    return server, f"http://{server.http_url}"


# ------------------------------------------------------------------------------ clients
async def _stream_openai(client, base: str, model: str, prompt: list[int], max_tokens: int):
    """Token ids in and out (the ``return_token_ids`` extension), so a conversation's next
    prompt holds exactly the tokens the server computed."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    times, tokens, answer = [], 0, []
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{base}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                choice = chunk["choices"][0]
                if choice.get("text"):
                    times.append(time.perf_counter())
                answer = choice.get("token_ids") or answer
    return times, tokens, answer


async def _stream_triton(client, base: str, model: str, prompt: str, max_tokens: int):
    """Text in and out (Triton's generate extension)."""
    body = {"text_input": prompt, "stream": True, "exclude_input_in_output": True,
            "return_num_output_tokens": True,
            "sampling_parameters": json.dumps({"max_tokens": max_tokens, "temperature": 0})}
    times, tokens, answer = [], 0, ""
    async with client.stream("POST", f"{base}/v2/models/{model}/generate_stream", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{base}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{base}: {chunk['error']}")
            if chunk.get("num_output_tokens") is not None:
                tokens = max(tokens, int(np.asarray(chunk["num_output_tokens"]).reshape(-1)[0]))
            if chunk.get("text_output"):
                times.append(time.perf_counter())
                answer += chunk["text_output"]
    return times, tokens, answer


async def run_load(bases: list[str], kind: str, model: str, sessions, tokenizer, *, concurrency: int) -> dict:
    """Closed loop: ``concurrency`` clients share the sessions; request i goes to bases[i % n]."""
    import httpx

    stream = _stream_openai if kind == "openai" else _stream_triton
    queue: asyncio.Queue = asyncio.Queue()
    for s in sessions:
        queue.put_nowait(s)
    counter = iter(range(10 ** 9))
    records: list[dict] = []

    async def client_loop(client) -> None:
        while True:
            try:
                session = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            history: list[int] | str = [] if kind == "openai" else ""
            for turn in session.turns:  # a turn's prompt: the system prompt, earlier turns and answers, the turn
                if kind == "openai":
                    prompt = list(session.prefix) + history + list(turn)
                else:
                    prompt = tokenizer.decode(list(session.prefix)) + history + tokenizer.decode(list(turn))
                base = bases[next(counter) % len(bases)]
                t0 = time.perf_counter()
                times, tokens, answer = await stream(client, base, model, prompt, session.max_new_tokens)
                t1 = time.perf_counter()
                records.append({"ttft": (times[0] - t0) if times else None,
                                "itl": list(np.diff(times)) if len(times) > 1 else [], "e2e": t1 - t0,
                                "tokens": tokens or len(times)})
                history = history + (list(turn) + list(answer) if kind == "openai"
                                     else tokenizer.decode(list(turn)) + answer)

    limits = httpx.Limits(max_connections=concurrency * 2)
    t_start = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    wall = time.perf_counter() - t_start
    ttft = [r["ttft"] for r in records if r["ttft"] is not None]
    itl = [x for r in records for x in r["itl"]]
    e2e = [r["e2e"] for r in records]
    q = lambda xs, p: round(float(np.percentile(xs, p)), 4) if xs else None  # noqa: E731
    out_tokens = sum(r["tokens"] for r in records)
    return {"concurrency": concurrency, "requests": len(records), "wall_s": round(wall, 2),
            "output_tokens": out_tokens, "output_tok_s": round(out_tokens / wall, 2),
            "requests_s": round(len(records) / wall, 3),
            "ttft_p50": q(ttft, 50), "ttft_p99": q(ttft, 99), "itl_p50": q(itl, 50), "itl_p99": q(itl, 99),
            "e2e_p50": q(e2e, 50), "e2e_p99": q(e2e, 99)}


def scrape(base: str, path: str = "/metrics") -> dict[str, float]:
    """Sum of each tieredkv_* metric's samples by name{labels}."""
    import httpx

    text = httpx.get(base + path, timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tieredkv_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = out.get(name, 0.0) + float(value)
    return out


def _prefix_counts(metrics: list[dict[str, float]]) -> dict:
    tot = lambda pattern: sum(v for m in metrics for k, v in m.items() if re.fullmatch(pattern, k))  # noqa: E731
    return {"prompt_tokens": tot(r"tieredkv_prompt_tokens_total.*"),
            "cached_tokens": tot(r"tieredkv_prefix_cached_tokens_total.*"),
            "remote_hit_pages": tot(r'tieredkv_remote_pages_total\{outcome="hit"\}'),
            "remote_written_pages": tot(r'tieredkv_remote_pages_total\{outcome="written"\}')}


# ------------------------------------------------------------------------------ experiments
def make_workload(args):
    from tieredkv.models.hub import resolve_model
    from tieredkv.models.loading import load_checkpoint
    from tieredkv.runtime.eval.data import load_text
    from tieredkv.runtime.serving.bench import make_sessions

    loaded = load_checkpoint(resolve_model(args.model, log=_log))
    ids = loaded.tokenizer.encode(load_text(args.text_file, log=_log), add_bos=False)
    return loaded.tokenizer, lambda seed: make_sessions(
        "chat", ids, sessions=args.sessions, seed=seed, system_tokens=args.system_tokens, turns=args.turns,
        user_tokens=(24, 64), max_new_tokens=args.max_new_tokens)


def exp_doors(args, workdir: Path, tokenizer, sessions_for) -> list[dict]:
    rows = []
    for door in args.doors:
        server = None
        try:
            if door == "openai":
                server, base = start_openai(args, workdir, "openai")
                model = json.loads(__import__("httpx").get(base + "/v1/models").text)["data"][0]["id"]
            else:
                server, base = start_triton(args, workdir)
                model = "tieredkv"
            for i, c in enumerate(args.concurrency):
                res = asyncio.run(run_load([base], door, model, sessions_for(100 + i), tokenizer, concurrency=c))
                res.update(experiment="doors", arm=door)
                _log(json.dumps(res))
                rows.append(res)
        finally:
            if server is not None:
                server.stop()
    return rows


def exp_replicas(args, workdir: Path, tokenizer, sessions_for) -> list[dict]:
    import httpx

    rows = []
    for arm in ("2 replicas, no remote tier", "2 replicas + Redis remote tier"):
        procs: list = []
        try:
            extra: tuple[str, ...] = ()
            if "Redis" in arm:
                redis, url = start_redis(workdir)
                procs.append(redis)
                extra = ("--remote-kv", url)
            bases = []
            for r in range(2):
                p, base = start_openai(args, workdir, f"replica{r}-{'remote' if extra else 'local'}", *extra)
                procs.append(p)
                bases.append(base)
            model = json.loads(httpx.get(bases[0] + "/v1/models").text)["data"][0]["id"]
            for i, c in enumerate(args.concurrency):
                before = [scrape(b) for b in bases]
                res = asyncio.run(run_load(bases, "openai", model, sessions_for(200 + i), tokenizer, concurrency=c))
                after = [scrape(b) for b in bases]
                b0, a0 = _prefix_counts(before), _prefix_counts(after)
                res.update({k: a0[k] - b0[k] for k in a0})
                res.update(experiment="replicas", arm=arm)
                _log(json.dumps(res))
                rows.append(res)
        finally:
            for p in reversed(procs):
                p.stop()
    return rows


def exp_remote(args, workdir: Path) -> list[dict]:
    """In process, no HTTP: a cold replica's time to first token on a long shared prompt
    (``--doc-tokens``) with its pages in the remote tier (raw, and with the int4 warm codec)
    against computing them; the bytes read and the tokens' agreement with the computing one."""
    from tieredkv.models.hub import resolve_model
    from tieredkv.models.loading import load_checkpoint
    from tieredkv.runtime.eval.data import load_text
    from tieredkv.runtime.sampling import SamplingParams
    from tieredkv.runtime.serving.deploy import EngineArgs

    loaded = load_checkpoint(resolve_model(args.model, log=_log))
    ids = loaded.tokenizer.encode(load_text(args.text_file, log=_log), add_bos=False)
    redis, url = start_redis(workdir)
    rows = []
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    try:
        for codec in (None, "int4"):
            kv = {"device_budget": args.kv_budget or "25%", **({"warm_codec": codec} if codec else {})}
            sched = {"max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs}
            for trial in range(args.trials):
                doc = ids[trial * args.doc_tokens: (trial + 1) * args.doc_tokens]
                ns = f"bench{trial}{codec or 'raw'}"

                def replica(remote: bool):
                    return EngineArgs(kv=kv, scheduler=sched, remote={"url": url, "namespace": ns} if remote else None
                                      ).build_engine(loaded.model, loaded.tokenizer)

                def first(engine):
                    t0 = time.perf_counter()
                    req = engine.add_request(doc, params)
                    engine.run()
                    return req, req.metrics.ttft, time.perf_counter() - t0

                writer = replica(True)
                ra, ttft_a, _ = first(writer)
                writer.close()
                cold = replica(False)
                rc, ttft_c, _ = first(cold)
                reader = replica(True)
                rb, ttft_b, _ = first(reader)
                st = reader.remote.stats
                rows.append({"experiment": "remote", "arm": f"codec {codec or 'raw'}", "trial": trial,
                             "prompt_tokens": len(doc), "ttft_compute_s": round(ttft_c, 3),
                             "ttft_remote_s": round(ttft_b, 3), "speedup": round(ttft_c / ttft_b, 2),
                             "remote_hit_pages": st.hit_pages, "remote_read_mib": round(st.bytes_read / 2 ** 20, 2),
                             "remote_read_s": round(st.read_seconds, 3),
                             "page_entry_kib": round(reader.remote.entry_bytes / 1024, 1),
                             "same_tokens": rb.out.token_ids == rc.out.token_ids,
                             "writer_same_tokens": ra.out.token_ids == rc.out.token_ids})
                _log(json.dumps(rows[-1]))
                reader.close()
    finally:
        redis.stop()
    return rows


def markdown(rows: list[dict]) -> str:
    cols = ["experiment", "arm", "concurrency", "requests", "output_tok_s", "ttft_p50", "ttft_p99", "itl_p50",
            "itl_p99", "e2e_p50", "e2e_p99", "cached_tokens", "remote_hit_pages"]
    out = []
    for kind in ("doors", "replicas", "remote"):
        part = [r for r in rows if r["experiment"] == kind]
        if not part:
            continue
        use = cols if kind != "remote" else list(part[0])
        use = [c for c in use if any(r.get(c) is not None for r in part)]
        out.append("| " + " | ".join(use) + " |")
        out.append("|" + "---|" * len(use))
        for r in part:
            out.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in use) + " |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiments", nargs="+", default=["doors", "replicas", "remote"],
                   choices=["doors", "replicas", "remote"])
    p.add_argument("--doors", nargs="+", default=["openai", "triton"], choices=["openai", "triton"])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--text-file", default=None, help="the workload's text (default: the Paul Graham essays)")
    p.add_argument("--kv-budget", default="25%", help="the servers' --kv-budget ('' for the plain paged cache)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--doc-tokens", type=int, default=2048, help="remote experiment: the shared prompt's length")
    p.add_argument("--trials", type=int, default=2, help="remote experiment: prompts per codec")
    p.add_argument("--out", default="results/front-doors")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="tieredkv-load-"))
    os.environ.setdefault("TQDM_DISABLE", "1")
    tokenizer, sessions_for = make_workload(args)
    rows: list[dict] = []
    t0 = time.perf_counter()
    if "doors" in args.experiments:
        rows += exp_doors(args, workdir, tokenizer, sessions_for)
    if "replicas" in args.experiments:
        rows += exp_replicas(args, workdir, tokenizer, sessions_for)
    if "remote" in args.experiments:
        rows += exp_remote(args, workdir)
    meta = {"command": "python tools/load_front_doors.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPU cores, no GPU",
            "seconds": round(time.perf_counter() - t0, 1), "settings": vars(args)}
    (out / "front_doors.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (out / "front_doors.md").write_text(markdown(rows))
    print(markdown(rows))
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
