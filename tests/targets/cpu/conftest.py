"""Fixtures shared by the code generator's tests."""

from __future__ import annotations

import os
import platform
import shlex

import pytest

from tests.on_targets import compiler_defines

#: builds narrower than the machine's own: the flags a ``CC`` wrapper adds after the kernel
#: flags, the macro that must then be undefined and the one that must still be defined
NARROWER_BUILDS = {
    "portable": (("-mno-avx2", "-mno-fma"), "__AVX2__", None),
    "avx2": (("-mno-avx512f",), "__AVX512F__", "__AVX2__"),
}


@pytest.fixture(params=sorted(NARROWER_BUILDS))
def narrower_cc(request, tmp_path, monkeypatch) -> str:
    """``CC`` building for a narrower vector unit than this machine's, so the packers' and
    the micro-kernel's other branches are what runs: ``portable`` without AVX2 (GCC vector
    extensions), ``avx2`` with AVX2 + FMA but without AVX-512 (where the machine has it)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("AVX2 and AVX-512 are x86 extensions")
    flags, removed, kept = NARROWER_BUILDS[request.param]
    if kept is not None and not compiler_defines(kept):
        pytest.skip(f"this machine has no {kept.strip('_')}")
    script = tmp_path / "cc-narrower"
    script.write_text(f'#!/bin/sh\nexec {shlex.join(shlex.split(os.environ.get("CC", "cc")))} "$@" {" ".join(flags)}\n')
    script.chmod(0o755)
    monkeypatch.setenv("CC", str(script))
    assert not compiler_defines(removed), f"the wrapper should build without {removed.strip('_')}"
    assert kept is None or compiler_defines(kept), f"the wrapper should still build with {kept.strip('_')}"
    return request.param
