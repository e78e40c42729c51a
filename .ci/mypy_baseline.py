"""Runs mypy (configured in pyproject.toml) and compares its errors with a baseline.

The baseline (.ci/mypy-baseline.txt) holds the errors that were there when mypy was added to
CI, one a line as `path: error: message  [code]`: no line number, so that unrelated edits
above an error do not change it. A line that occurs twice stands for two errors.

    python .ci/mypy_baseline.py            check: exit 1 on an error not in the baseline,
                                           and on a baseline entry that no longer occurs
    python .ci/mypy_baseline.py --update   rewrite the baseline with today's errors

The baseline only shrinks: fix an error, then delete its line (or run --update and check
that the diff only removes lines). New code gets no baseline entries: fix what mypy says.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = os.path.join(REPO, ".ci", "mypy-baseline.txt")
HEADER = (
    "# mypy errors known when the type check was added (see .ci/mypy_baseline.py).\n"
    "# Only ever delete lines: fix an error, then remove its line.\n"
)
# `path:line: error: message  [code]` (mypy's default output, --show-error-codes).
ERROR = re.compile(r"^(?P<path>[^:\s]+\.pyi?):(?P<line>\d+)(?::\d+)?: error: (?P<rest>.*)$")


def parse(output: str) -> list[tuple[str, str]]:
    """mypy's errors in `output` as [(normalised error, the line mypy printed)]; notes and
    other lines are left out. Normalised: `path: error: message  [code]`, no line number."""
    errors = []
    for line in output.splitlines():
        m = ERROR.match(line)
        if m:
            errors.append((f"{m['path']}: error: {m['rest'].rstrip()}", line))
    return errors


def compare(
    errors: list[tuple[str, str]], baseline: collections.Counter[str]
) -> tuple[list[str], list[str]]:
    """(the printed lines of errors beyond the baseline, baseline entries that no longer
    occur). Entries count: a baseline line that occurs twice covers two equal errors."""
    current = collections.Counter(e for e, _ in errors)
    excess = current - baseline
    new = []
    for e, line in errors:
        if excess[e] > 0:
            new.append(line)
            excess[e] -= 1
    return new, sorted((baseline - current).elements())


def run_mypy() -> tuple[list[tuple[str, str]], str]:
    """Runs mypy from the repository root.

    Returns:
        ([(normalised error, the line mypy printed)], mypy's whole output).

    Raises:
        SystemExit: mypy did not run (exit status 2: bad configuration, a crash).
    """
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--show-error-codes",
            "--no-error-summary",
            "--no-pretty",
            "--no-color-output",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    output = proc.stdout + proc.stderr
    if proc.returncode not in (0, 1):
        sys.exit(f"mypy failed to run (exit status {proc.returncode}):\n{output}")
    errors = parse(output)
    if proc.returncode == 1 and not errors:
        sys.exit(f"mypy exited 1 but printed no error this script understands:\n{output}")
    return errors, output


def read_baseline() -> collections.Counter[str]:
    try:
        with open(BASELINE) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return collections.Counter()
    return collections.Counter(x for x in lines if x.strip() and not x.startswith("#"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true", help="rewrite the baseline")
    args = parser.parse_args(argv)
    errors, _ = run_mypy()
    current = collections.Counter(e for e, _ in errors)
    baseline = read_baseline()
    rel = os.path.relpath(BASELINE, REPO)
    if args.update:
        with open(BASELINE, "w") as f:
            f.write(HEADER)
            f.writelines(f"{e}\n" for e in sorted(current.elements()))
        added = sum((current - baseline).values())
        removed = sum((baseline - current).values())
        print(f"{rel}: {sum(current.values())} errors (+{added}, -{removed})")
        if added:
            print("added entries (only acceptable for errors that others' code brought in):")
            for e in sorted((current - baseline).elements()):
                print(f"  {e}")
        return 0
    new, gone = compare(errors, baseline)
    if new:
        print(f"mypy: {len(new)} error(s) not in {rel}; fix them:")
        for line in new:
            print(f"  {line}")
    if gone:
        print(
            f"mypy: {len(gone)} entry(ies) of {rel} no longer occur; delete them "
            f"(or run `python .ci/mypy_baseline.py --update`) so the baseline only shrinks:"
        )
        for e in gone:
            print(f"  {e}")
    if new or gone:
        return 1
    print(f"mypy: OK ({sum(current.values())} known errors in {rel}, none new)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
