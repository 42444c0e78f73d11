"""Real servers for tests, started on 127.0.0.1 and stopped by pid: Redis (Debian's
redis-server), the OpenAI-compatible server on a thread (``ServerThread``) and ``tieredkv
serve`` as a process (``start_cli``). Missing binaries skip the test, except where ``TIEREDKV_REQUIRE_SERVERS=1``
(CI, which installs them) makes that a failure."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tieredkv.runtime.serving.engine import AsyncEngine
from tieredkv.runtime.serving.openai_server import METRICS_CONTENT_TYPE, bind_socket, create_app
from tieredkv.runtime.serving.triton.server import free_ports

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    return free_ports(1)[0]


def need_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        msg = f"{name} is not installed (apt-get install redis-server; .ci/run installs it)"
        if os.environ.get("TIEREDKV_REQUIRE_SERVERS") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return path


class RedisServer:
    """``redis-server`` on a free loopback port, no persistence; ``stop()`` by pid."""

    def __init__(self, workdir: Path) -> None:
        binary = need_binary("redis-server")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(workdir)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        self.client = redis.Redis(port=self.port, socket_timeout=5)
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.client.ping():
                    break
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start (exit {self.proc.poll()})") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.client.close()


# ------------------------------------------------------------------------------ the OpenAI server
class ServerThread:
    """create_app on an AsyncEngine, served by uvicorn on a thread of its own (127.0.0.1, a free port)."""

    def __init__(self, served, *, api_key: str | None = None, tokenizer=None, **app_kw) -> None:
        import uvicorn

        self.served, self.api_key = served, api_key
        self.engine = AsyncEngine(served.engine)
        self.engine.start()
        app = create_app(self.engine, tokenizer or served.tokenizer, served.model_name, api_key=api_key, **app_kw)
        self.sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", self.api_key or "unused"),
                             max_retries=0, timeout=60, **kw)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0,
                                  timeout=60)

    def on_engine(self, fn):
        """Run ``fn`` on the engine thread between two steps (no race with the engine)."""
        return self.engine._submit(fn).result(timeout=30)

    def metrics(self) -> dict[str, float]:
        """/metrics parsed by prometheus_client: sample name{labels} -> value (and name -> sum)."""
        r = httpx.get(self.url + "/metrics", timeout=30)
        assert r.status_code == 200
        assert r.headers["content-type"] == METRICS_CONTENT_TYPE
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(r.text):
            for s in fam.samples:
                key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
                                if s.labels else "")
                out[key] = s.value
                if s.labels:
                    out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    def wait_idle(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while self.on_engine(self.served.engine.has_unfinished):
            assert time.monotonic() < deadline, "the engine still has requests"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        self.engine.stop_nowait()
        self.engine.join(20)
        self.sock.close()
        if hasattr(self.served.engine.cache, "close"):
            self.served.engine.cache.close()


def assert_no_leak(engine) -> None:
    """Nothing running and no page held for a finished request (test_invariants.py's checks)."""
    assert not engine.scheduler.has_work()
    assert all(r.finished for r in engine.requests.values())
    cache = engine.cache
    if hasattr(cache, "mgr"):
        mgr, t = cache.mgr, cache.mgr.table
        mgr.check_invariants()
        if engine.prefix is not None:
            engine.prefix.check()
        assert not set(t.seq_len), "a finished request still has a sequence"
        assert torch.equal(t.refs, t.cached.long()), "pages referenced beyond the prefix index's own references"
        assert int(mgr.device.used().max()) <= engine.scheduler.capacity
    else:
        assert cache.sequences == [] and cache.pages_in_use() == 0


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    assert "Traceback" not in exc.response.text
    return body["error"]


def start_cli(args: list[str], log: Path, timeout: float = 120) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "tieredkv.cli", "serve", "--port", "0", *args], stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO, env=env)
    deadline = time.monotonic() + timeout
    while True:
        text = log.read_text(errors="replace")
        for line in text.splitlines():
            if "tieredkv serve: listening on " in line:
                return proc, line.split("listening on ", 1)[1].strip()
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill() if proc.poll() is None else None
            raise AssertionError(f"tieredkv serve did not start:\n{text}")
        time.sleep(0.1)


def stop_cli(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise


