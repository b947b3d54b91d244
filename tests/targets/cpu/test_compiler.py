"""Building shared libraries: the cache, and clear errors."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import neoflow
from neoflow.errors import CompileError
from neoflow.targets import cache
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


# each worker builds, loads and calls: a library every worker builds, one of its own, and a library of
# several translation units (objects compiled at once, cached, linked) that every worker builds too
_WORKER = """
import os, sys
from neoflow.targets import cache
from neoflow.targets.cpu import compiler
compiler.UNIT_BYTES = 10
compiler.os.cpu_count = lambda: 2
worker = int(sys.argv[1])
shared = compiler.load_library("int nf_answer(void) { return 42; }\\n/* shared */")
own = compiler.load_library(f"int nf_answer(void) {{ return {worker}; }}\\n")
units = compiler.UNIT.join(f"int nf_f{k}(int x) {{ return x + {k}; }}" for k in range(4))
split = compiler.load_library("#include <stdint.h>" + compiler.UNIT + units)
print(shared.nf_answer(), own.nf_answer(), split.nf_f3(1))
"""


def test_eight_processes_compiling_the_same_and_different_kernels_into_one_cache(tmp_path) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "NEOFLOW_CACHE_DIR": str(tmp_path)}
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(w)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for w in range(8)
    ]
    outcomes = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0] * 8, [err.decode()[-500:] for _, err in outcomes]
    assert [out.split() for out, _ in outcomes] == [[b"42", str(w).encode(), b"4"] for w in range(8)]
    kernels = tmp_path / "kernels"
    assert len(list(kernels.glob("*.so"))) == 8 + 2 and len(list(kernels.glob("*.so.sha256"))) == 10
    assert len(list((kernels / "objects").glob("*.o"))) == 2  # the split library's units, built once each
    assert not [p.name for p in kernels.rglob(".*") if p.is_file()]  # no temporary file left behind


@pytest.mark.parametrize("damage", ["truncated", "corrupted", "digest lost"])
def test_a_damaged_cache_entry_is_detected_and_built_again(tmp_path, monkeypatch, damage) -> None:
    monkeypatch.setenv("NEOFLOW_CACHE_DIR", str(tmp_path))
    source = SOURCE + f"/* {damage} */\n"
    library = compiler.build_library(source)
    whole = library.read_bytes()
    if damage == "truncated":
        library.write_bytes(whole[: len(whole) // 2])
    elif damage == "corrupted":
        library.write_bytes(whole[:100] + bytes([whole[100] ^ 0xFF]) + whole[101:])
    else:
        library.with_name(library.name + ".sha256").unlink()
    assert compiler.build_library(source) == library and cache.intact(library)
    assert compiler.load_library(source).nf_answer() == 42


def test_a_large_source_is_split_into_translation_units_with_every_function_once(monkeypatch) -> None:
    monkeypatch.setattr(compiler, "UNIT_BYTES", 10)
    header = "#include <stdint.h>\nstatic inline int nf_twice(int x) { return 2 * x; }"
    functions = [
        f"static int helper{k}(int x) {{ return x + {k}; }}\n"
        f"int nf_f{k}(int x) {{\n    return helper{k}(nf_twice(x));\n}}"
        for k in range(5)
    ]
    entry = "int nf_all(int x) {\n    return nf_f0(x) + nf_f4(x);\n}"
    units = compiler.translation_units(header + compiler.UNIT + compiler.UNIT.join([*functions, entry]), 2)
    assert len(units) == 2
    for unit in units:
        assert unit.startswith(header)
        assert "int nf_f3(int x);" in unit and "int nf_all(int x);" in unit and "helper1(int x);" not in unit
    for k in range(5):
        assert sum(f"int nf_f{k}(int x) {{" in unit for unit in units) == 1
    assert compiler.translation_units("int nf_a(void) { return 1; }", 4) == ["int nf_a(void) { return 1; }"]


@NEEDS_CC
def test_a_model_compiled_in_several_units_at_once_runs_like_one(tmp_path, monkeypatch) -> None:
    """The kernels of a model spread over translation units compiled in parallel (objects cached, then
    linked) compute what the interpreter does."""
    monkeypatch.setenv("NEOFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiler, "UNIT_BYTES", 1000)
    monkeypatch.setattr(compiler.os, "cpu_count", lambda: 2)
    text = "\n".join(
        [
            "H[i, j] = ReduceAdd({k}, X[i, k] * W[k, j])",
            "R[i, j] = max(H[i, j], 0)",
            "Y[i] = ReduceAdd({j}, R[i, j] * R[i, j])",
        ]
    )
    graph = neoflow.graph(text, shapes={"X": (8, 16), "W": (16, 4)})
    rng = np.random.default_rng(0)
    inputs = {
        "X": rng.standard_normal((8, 16)).astype(np.float32),
        "W": rng.standard_normal((16, 4)).astype(np.float32),
    }
    got = neoflow.compile(graph, target="cpu", fusion="none").run(inputs)["Y"]
    assert len(list((tmp_path / "kernels" / "objects").glob("*.o"))) >= 2
    np.testing.assert_allclose(got, neoflow.evaluate(graph, inputs)["Y"], rtol=1e-5, atol=1e-5)


def test_loops_calling_math_functions_vectorise_with_the_vector_math_library(tmp_path, monkeypatch) -> None:
    """A GELU's erf and a sigmoid's exp: with glibc's libmvec the loops call its vector versions
    (``_ZGV...``) and compute what the interpreter does; ``NEOFLOW_VECTOR_MATH=0`` keeps them scalar."""
    monkeypatch.setenv("NEOFLOW_CACHE_DIR", str(tmp_path))
    op = neoflow.op(
        "Y[i, j] = 0.5 * X[i, j] * (1 + erf(X[i, j] * 0.7071067811865476)) + sigmoid(X[i, j]) * tanh(X[i, j])",
        shapes={"X": (64, 256)},
    )
    x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    expected = neoflow.compile(op, target="interp").run({"X": x})
    for setting in ("1", "0"):
        monkeypatch.setenv("NEOFLOW_VECTOR_MATH", setting)
        compiler.vector_math.cache_clear()
        layer = neoflow.compile(op, target="cpu")
        np.testing.assert_allclose(layer.run({"X": x}), expected, rtol=1e-5, atol=1e-6)
        vectorised = b"_ZGV" in layer._forward.library_path.read_bytes()
        assert vectorised == (setting == "1" and compiler.vector_math())
    compiler.vector_math.cache_clear()
