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

HAS_CC = shutil.which(os.environ.get("CC", "cc")) is not None
TARGETS = ["interp", *(["cpu"] if HAS_CC else [])]
NEEDS_CC = pytest.mark.skipif(not HAS_CC, reason="no C compiler")


def evaluate_on(target: str, program: Op | Graph, inputs: Mapping[str, np.ndarray]):
    """``neoflow.evaluate`` on ``target``: an op's output array, or a graph's outputs by name."""
    if target == "interp":
        return neoflow.evaluate(program, inputs)
    if isinstance(program, Graph):
        program = dataclasses.replace(program, source_names={})  # inputs and outputs by graph names
    return neoflow.compile(program, target=target).run(inputs)
