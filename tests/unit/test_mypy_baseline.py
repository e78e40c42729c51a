"""`.ci/mypy_baseline.py`: how mypy's output is normalised and compared with the baseline
(no mypy run here)."""

from __future__ import annotations

import collections
import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "mypy_baseline", os.path.join(REPO, ".ci", "mypy_baseline.py")
)
assert _spec is not None and _spec.loader is not None
mypy_baseline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mypy_baseline)

OUTPUT = """\
python/dataservice/a.py:12: error: Module has no attribute "X"  [attr-defined]
python/dataservice/a.py:40: error: Module has no attribute "X"  [attr-defined]
python/dataservice/b.py:7:5: error: Incompatible types  [assignment]
python/dataservice/b.py:7: note: "f" defined here
Success: no issues found in 1 source file
"""


def test_parse_drops_line_numbers_columns_and_notes() -> None:
    got = [e for e, _ in mypy_baseline.parse(OUTPUT)]
    assert got == [
        'python/dataservice/a.py: error: Module has no attribute "X"  [attr-defined]',
        'python/dataservice/a.py: error: Module has no attribute "X"  [attr-defined]',
        "python/dataservice/b.py: error: Incompatible types  [assignment]",
    ]


def test_compare_counts_repeated_entries_and_reports_both_directions() -> None:
    errors = mypy_baseline.parse(OUTPUT)
    a, b = errors[0][0], errors[2][0]
    # The baseline covers one of the two equal errors in a.py, and one that is gone.
    baseline = collections.Counter({a: 1, b: 1, "python/dataservice/c.py: error: old  [x]": 1})
    new, gone = mypy_baseline.compare(errors, baseline)
    # One of the two a.py errors is beyond the baseline (which one cannot be told apart).
    assert len(new) == 1 and new[0] in {line for e, line in errors if e == a}
    assert gone == ["python/dataservice/c.py: error: old  [x]"]
    assert mypy_baseline.compare(errors, collections.Counter([a, a, b])) == ([], [])
