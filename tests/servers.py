"""Real servers for tests, started on 127.0.0.1 and stopped by pid: Redis (Debian's
redis-server). Missing binaries skip the test, except where ``TIEREDKV_REQUIRE_SERVERS=1``
(CI, which installs them) makes that a failure."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tieredkv.runtime.serving.triton.server import free_ports


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
