"""`mypy --strict` on the package's source, and on a caller (typing/usage.py) that sees the
installed package: its `py.typed` is shipped and its public types are precise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PYTHON = Path(__file__).resolve().parents[1]


def _mypy(args, cwd: Path, cache: Path) -> None:
    pytest.importorskip("mypy", reason="mypy is in python/requirements-test.txt")
    r = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-error-summary",
                        "--cache-dir", str(cache), *args],
                       cwd=cwd, capture_output=True, text=True)
    assert r.returncode == 0, f"mypy {' '.join(args)}:\n{r.stdout}{r.stderr}"


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory) -> Path:
    """One cache for both runs: the second reuses what the first learnt of the standard library,
    numpy and requests (about half of each run's time)."""
    return tmp_path_factory.mktemp("mypy-cache")


def test_the_package_passes_mypy_strict(tmp_path, mypy_cache):
    _mypy(["--config-file", str(PYTHON / "pyproject.toml"), str(PYTHON / "xdistill")],
          cwd=tmp_path, cache=mypy_cache)


def test_callers_see_precise_types_of_the_installed_package(tmp_path, mypy_cache):
    # From a directory without the source tree, so `import xdistill` is the installed package.
    _mypy([str(PYTHON / "tests" / "typing" / "usage.py")], cwd=tmp_path, cache=mypy_cache)
