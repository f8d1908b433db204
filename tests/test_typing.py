"""Types that reach users: ``mypy --strict`` over code that uses dpfast (a typed user script, a file of misuse, the
examples), as ``make typecheck`` runs it. The user script and the examples must pass without an error; every misuse
line must get the error it is marked with, and nothing else may.

One mypy run covers all three (mypy's first run reads torch and takes about half a minute; its cache, in the source
tree's ``.mypy_cache`` as for ``make typecheck``, makes later runs take seconds).
"""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy", reason="mypy is not installed (the Makefile's dependency list has it)")

TREE = Path(__file__).resolve().parent.parent
TYPED = TREE / "tests" / "typed"
USER_CODE = TYPED / "user_code.py"
MISUSE = TYPED / "misuse.py"
EXAMPLES = TREE / "examples"
ERROR = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): error: (?P<message>.*?)(?:  \[(?P<code>[\w-]+)\])?$")
EXPECT = re.compile(r"#\s*expect:\s*(?P<code>[\w-]+)")


def _relative(path: Path) -> str:
    return str(path.relative_to(TREE))


@pytest.fixture(scope="module")
def mypy_errors() -> dict[str, list[tuple[int, str, str]]]:
    """``{file: [(line, code, message), ...]}`` from one ``mypy --strict`` run over the user script, the misuse
    file and the examples (when the tree has them), run from the source tree as ``make typecheck`` runs it."""
    targets = [USER_CODE, MISUSE] + ([EXAMPLES] if EXAMPLES.is_dir() else [])
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", _relative(TYPED / "mypy.ini"), "--no-pretty"]
        + ["--show-error-codes", "--no-error-summary"]
        + [_relative(t) for t in targets],
        cwd=TREE,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode in (0, 1), f"mypy crashed or was misconfigured:\n{proc.stdout}\n{proc.stderr}"
    errors: dict[str, list[tuple[int, str, str]]] = {}
    for line in proc.stdout.splitlines():
        m = ERROR.match(line)
        if m:
            errors.setdefault(m["file"], []).append((int(m["line"]), m["code"] or "", m["message"]))
    return errors


def _lines(errors: list[tuple[int, str, str]]) -> str:
    return "\n".join(f"  line {line}: {message} [{code}]" for line, code, message in errors)


def test_typed_user_code_passes_mypy_strict(mypy_errors):
    errors = mypy_errors.get(_relative(USER_CODE), [])
    assert not errors, f"mypy --strict on {USER_CODE.name}:\n{_lines(errors)}"


def test_typed_user_code_runs():
    """The script type-checks and does what it says, on the CPU."""
    runpy.run_path(str(USER_CODE), run_name="__main__")


def test_misuse_is_reported(mypy_errors):
    expected = {n: m["code"] for n, line in enumerate(MISUSE.read_text().splitlines(), 1) if (m := EXPECT.search(line))}
    assert len(expected) >= 10
    got: dict[int, list[str]] = {}
    for line, code, _ in mypy_errors.get(_relative(MISUSE), []):
        got.setdefault(line, []).append(code)
    missed = {n: code for n, code in expected.items() if code not in got.get(n, [])}
    unexpected = {n: codes for n, codes in got.items() if codes != [expected.get(n)]}
    assert not missed, f"misuse mypy --strict did not report (line: expected code): {missed}"
    assert not unexpected, f"errors mypy reported that misuse.py does not mark (line: codes): {unexpected}"


@pytest.mark.skipif(not EXAMPLES.is_dir(), reason="the source tree has no examples/")
def test_examples_pass_mypy_strict(mypy_errors):
    errors = {f: e for f, e in mypy_errors.items() if f.startswith("examples")}
    assert not errors, "mypy --strict on examples/:\n" + "\n".join(f"{f}:\n{_lines(e)}" for f, e in errors.items())
