"""The tree is ruff clean."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean() -> None:
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed (it is in the test extras)")
    done = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
