"""The T4 disk tier never destroys a user's file: its file is created exclusively (never over an
existing file, never through a symbolic link), private (0600), removed when the cache closes,
at exit and on SIGTERM, and a file a killed process left behind is recognised and removed the
next time."""

import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from helpers import SMALL_KV as SMALL, tiny_model
from tieredkv.errors import ConfigError
from tieredkv.models.llama import prefill
from tieredkv.runtime.tiered.cache import TieredKVCache
from tieredkv.runtime.tiered.config import TieredKVConfig
from tieredkv.runtime.tiered.store import T4_MAGIC, create_t4_file

MODEL = tiny_model(seed=3)


def spilling_cache(disk_path) -> TieredKVCache:
    cfg = TieredKVConfig(policy="lru", device_budget=96, host_budget=32, disk_path=str(disk_path), **SMALL)
    cache = TieredKVCache(MODEL.kv_spec(), cfg)
    prefill(MODEL, cache, cache.add_sequence(), torch.arange(300) % 500, chunk_size=64)
    assert cache.metrics.spilled_pages > 0
    return cache


def test_an_existing_file_is_never_overwritten(tmp_path):
    mine = tmp_path / "notes.txt"
    mine.write_text("my data")
    with pytest.raises(ConfigError, match="exists .*never overwrites"):
        TieredKVCache(MODEL.kv_spec(), TieredKVConfig(device_budget=96, disk_path=str(mine), **SMALL))
    assert mine.read_text() == "my data"


def test_a_symbolic_link_is_never_followed(tmp_path):
    target = tmp_path / "precious.bin"
    target.write_bytes(b"\x01\x02")
    for link_to in (target, tmp_path / "does-not-exist"):
        link = tmp_path / f"t4-{link_to.name}"
        link.symlink_to(link_to)
        with pytest.raises(ConfigError, match="symbolic link"):
            TieredKVCache(MODEL.kv_spec(), TieredKVConfig(device_budget=96, disk_path=str(link), **SMALL))
    assert target.read_bytes() == b"\x01\x02" and not (tmp_path / "does-not-exist").exists()


def test_a_private_file_removed_when_the_cache_closes(tmp_path):
    path = tmp_path / "sub" / "t4.kv"
    cache = spilling_cache(path)
    assert path.is_file() and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes()[: len(T4_MAGIC)] == T4_MAGIC
    cache.close()
    assert not path.exists()


def test_a_directory_gets_a_private_file_inside(tmp_path):
    cache = spilling_cache(tmp_path)
    (made,) = list(tmp_path.iterdir())
    assert made.name.startswith(f"tieredkv-t4-{os.getpid()}-") and stat.S_IMODE(made.stat().st_mode) == 0o600
    del cache  # garbage-collected without close(): the file goes too
    import gc

    gc.collect()
    assert list(tmp_path.iterdir()) == []


def _run_cache_until_signalled(disk_path, *, handle_signals: bool) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import sys, time, torch
        sys.path.insert(0, {str(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))!r})
        from helpers import tiny_model
        from tieredkv.models.llama import prefill
        from tieredkv.runtime.tiered.cache import TieredKVCache
        from tieredkv.runtime.tiered.config import TieredKVConfig
        from tieredkv.lifecycle import signals_exit
        model = tiny_model(seed=3)
        cfg = TieredKVConfig(policy="lru", device_budget=96, host_budget=32, disk_path={str(disk_path)!r},
                             page_size=8, sink_tokens=4, recent_tokens=16, staging_pages=2)
        def work():
            cache = TieredKVCache(model.kv_spec(), cfg)
            prefill(model, cache, cache.add_sequence(), torch.arange(300) % 500, chunk_size=64)
            print("ready", flush=True)
            time.sleep(60)
        if {handle_signals}:
            with signals_exit():
                work()
        else:
            work()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_remove_the_file(tmp_path, signum):
    path = tmp_path / "t4.kv"
    proc = _run_cache_until_signalled(path, handle_signals=True)
    assert path.is_file()
    proc.send_signal(signum)
    assert proc.wait(timeout=30) == 128 + signum
    assert not path.exists()


def test_a_killed_runs_file_is_removed_next_time(tmp_path):
    path = tmp_path / "t4.kv"
    proc = _run_cache_until_signalled(path, handle_signals=False)
    proc.kill()  # SIGKILL: nothing can run
    proc.wait(timeout=30)
    assert path.is_file()  # left behind...
    spilling_cache(path).close()  # ... and recognised as stale at the next start: no "exists" error
    assert not path.exists()
    # the same in a directory: stale files of dead processes go, live ones stay
    proc = _run_cache_until_signalled(tmp_path, handle_signals=False)
    live = [f for f in tmp_path.iterdir() if f.name.startswith(f"tieredkv-t4-{proc.pid}-")]
    other = _run_cache_until_signalled(tmp_path, handle_signals=False)
    proc.kill()
    proc.wait(timeout=30)
    create_t4_file(tmp_path).unlink()
    assert not live[0].exists() and any(f.name.startswith(f"tieredkv-t4-{other.pid}-") for f in tmp_path.iterdir())
    other.kill()
    other.wait(timeout=30)


def test_the_running_owners_file_is_refused(tmp_path):
    path = create_t4_file(tmp_path / "t4.kv")  # this process is alive
    with pytest.raises(ConfigError, match=f"T4 file of running process {os.getpid()}"):
        create_t4_file(path)
    path.unlink()
