"""The README's "Sources" examples (its `py` blocks) run as written and print what their
comments say."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _section_blocks() -> list[str]:
    text = README.read_text()
    section = text.split("\n## Sources\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```py\n(.*?)```", section, re.DOTALL)


def test_the_sources_section_has_one_example_per_format():
    assert len(_section_blocks()) == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("index", [0, 1, 2], ids=["tfrecord", "parquet", "webdataset"])
def test_readme_sources_example_runs_and_prints_its_comments(index, capsys):
    block = _section_blocks()[index]
    if "pyarrow" in block:
        pytest.importorskip("pyarrow")
    exec(compile(block, f"README.md Sources block {index}", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    expected = [line.split("# ", 1)[1] for line in block.splitlines() if "print(" in line]
    assert printed == expected
