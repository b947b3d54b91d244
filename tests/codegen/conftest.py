"""Fixtures shared by the code generator's tests."""

from __future__ import annotations

import os
import platform
import shlex

import pytest

from neoflow.codegen.compiler import load_library


@pytest.fixture
def portable_cc(tmp_path, monkeypatch) -> None:
    """``CC`` building without AVX2 (a wrapper adding ``-mno-avx2 -mno-fma`` after the
    kernel flags), so the packers' and the micro-kernel's portable branches are what runs."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("AVX2 is an x86 extension")
    script = tmp_path / "cc-no-avx2"
    script.write_text(
        f'#!/bin/sh\nexec {shlex.join(shlex.split(os.environ.get("CC", "cc")))} "$@" -mno-avx2 -mno-fma\n'
    )
    script.chmod(0o755)
    monkeypatch.setenv("CC", str(script))
    probe = "int nf_avx2(void) {\n#ifdef __AVX2__\n    return 1;\n#else\n    return 0;\n#endif\n}\n"
    assert load_library(probe).nf_avx2() == 0, "the wrapper should build without AVX2"
