"""The README's Python blocks run as written, each in a fresh namespace (the real default
model: marked slow)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M)


def test_the_readme_has_python_blocks():
    assert python_blocks() and all(b.strip() for b in python_blocks())


@pytest.mark.slow
@pytest.mark.parametrize("k", range(len(python_blocks())))
def test_a_readme_python_block_runs(k, capsys):
    block = python_blocks()[k]
    exec(compile(block, f"README.md, Python block {k}", "exec"), {"__name__": "__readme__"})  # noqa: S102
    out = capsys.readouterr().out
    if "many_prompts" in block:  # the batch reports the prompts that cannot run instead of raising
        assert "empty" in out and "lone surrogate" in out
