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


# Every python block after the usage example: the four mode examples, the
# pickled-elements one, the pipeline ops one, and any added since.
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)


def test_readme_has_its_examples():
    assert len(BLOCKS) >= 7, (
        "README.md: the usage example, four mode examples, the pickled-elements one and "
        "the pipeline ops one"
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("index", range(1, len(BLOCKS)))
def test_readme_mode_examples_run(index):
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {})
