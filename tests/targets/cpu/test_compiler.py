"""Building shared libraries: the cache, and clear errors."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import neoflow
from neoflow.errors import CompileError
from neoflow.targets.cpu import compiler
from tests.on_targets import NEEDS_CC

pytestmark = NEEDS_CC

SOURCE = "int nf_answer(void) { return 42; }\n"


def test_library_is_cached_by_source(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("NEOFLOW_CACHE_DIR", str(tmp_path))
    first = compiler.build_library(SOURCE)
    assert first.parent == tmp_path / "kernels" and first.with_suffix(".c").read_text() == SOURCE
    stamp = first.stat().st_mtime_ns
    assert compiler.build_library(SOURCE) == first and first.stat().st_mtime_ns == stamp
    assert compiler.build_library(SOURCE + "\n") != first
    assert compiler.load_library(SOURCE).nf_answer() == 42


ERRNO_PROBE = """
#include <errno.h>
#include <math.h>
int nf_errno_after_sqrt(float x) { errno = 0; volatile float y = sqrtf(x); (void)y; return errno; }
"""


def test_math_functions_leave_errno_alone_so_the_compiler_may_hoist_and_vectorise_them() -> None:
    # with errno set by sqrtf/powf the compiler must call them at every point: an Adam update
    # recomputing its bias corrections (pow of the step) per element ran 7x slower
    library = compiler.load_library(ERRNO_PROBE)
    library.nf_errno_after_sqrt.argtypes = [ctypes.c_float]
    assert library.nf_errno_after_sqrt(-1.0) == 0


def test_a_different_compiler_command_builds_its_own_library(tmp_path, monkeypatch) -> None:
    # a wrapper (or CC with flags of its own) may build other code from the same compiler and source
    monkeypatch.setenv("NEOFLOW_CACHE_DIR", str(tmp_path))
    plain = compiler.build_library(SOURCE)
    monkeypatch.setenv("CC", f"{compiler.compiler()} -DNF_OTHER=1")
    assert compiler.build_library(SOURCE) != plain


def test_missing_compiler_is_a_clear_error_and_interp_still_works(monkeypatch) -> None:
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(CompileError, match=r"no C compiler found \('no-such-cc'\); .* use target='interp'"):
        neoflow.compile(neoflow.op("Y[i] = X[i] + 1", shapes={"X": (3,)}), target="cpu")
    layer = neoflow.compile(neoflow.op("Y[i] = X[i] + 1", shapes={"X": (3,)}), target="interp")
    np.testing.assert_array_equal(layer.run({"X": np.zeros(3)}), np.ones(3))


def test_compile_failure_shows_the_compiler_output(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("NEOFLOW_CACHE_DIR", str(tmp_path))
    with pytest.raises(CompileError) as err:
        compiler.build_library("int broken( {\n")
    message = str(err.value)
    assert "the C compiler failed" in message and "error" in message and "\n" not in message
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-built left behind


def test_two_processes_compiling_at_once(tmp_path) -> None:
    import subprocess
    import sys

    code = "import sys; from neoflow.targets.cpu import compiler; print(compiler.load_library(sys.argv[1]).nf_answer())"
    env = {**__import__("os").environ, "NEOFLOW_CACHE_DIR": str(tmp_path)}
    source = SOURCE + "/* race */\n"
    runs = [subprocess.Popen([sys.executable, "-c", code, source], env=env, stdout=subprocess.PIPE) for _ in range(3)]
    assert [p.communicate()[0].strip() for p in runs] == [b"42"] * 3
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 1
