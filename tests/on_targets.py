"""Run a test's op or graph on each target: the interpreter, and compiled C where a compiler exists."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Mapping

import numpy as np
import pytest

import neoflow
from neoflow.ir import Graph, Op
from neoflow.targets.cpu.compiler import load_library

HAS_CC = shutil.which(os.environ.get("CC", "cc")) is not None
TARGETS = ["interp", *(["cpu"] if HAS_CC else [])]
NEEDS_CC = pytest.mark.skipif(not HAS_CC, reason="no C compiler")


def compiler_defines(macro: str) -> bool:
    """Whether the C compiler, with the kernels' flags (and ``CC`` as set now), defines ``macro``."""
    probe = f"int nf_defines(void) {{\n#ifdef {macro}\n    return 1;\n#else\n    return 0;\n#endif\n}}\n"
    return bool(load_library(probe).nf_defines())


def evaluate_on(target: str, program: Op | Graph, inputs: Mapping[str, np.ndarray]):
    """``neoflow.evaluate`` on ``target``: an op's output array, or a graph's outputs by name."""
    if target == "interp":
        return neoflow.evaluate(program, inputs)
    if isinstance(program, Graph):
        program = dataclasses.replace(program, source_names={})  # inputs and outputs by graph names
    return neoflow.compile(program, target=target).run(inputs)


def assert_compiled_matches_interpreter(op: Op, seed: int) -> None:
    """``op`` compiled for the CPU gives the interpreter's result on standard-normal
    float32 inputs drawn with ``seed`` (float32 tolerance scaled by the result)."""
    rng = np.random.default_rng(seed)
    inputs = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in op.inputs}
    expected = neoflow.evaluate(op, inputs)
    got = neoflow.compile(op, target="cpu").run(inputs)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
