"""The README's usage example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.timeout(120)
def test_readme_usage_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert blocks, "README.md has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    for worker in namespace["workers"]:
        worker.stop()
    namespace["dispatcher"].stop()
    out = capsys.readouterr().out
    lines = out.splitlines()
    # DYNAMIC: each of the 1000 elements once per epoch (each worker batches its share)
    assert [line.split()[:2] for line in lines] == [["0", "1000"], ["1", "1000"]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("index", [1, 2, 3, 4, 5])
def test_readme_mode_examples_run(index):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert len(blocks) == 6, (
        "README.md: the usage example, four mode examples and the pickled-elements one"
    )
    exec(compile(blocks[index], f"README.md block {index}", "exec"), {})
