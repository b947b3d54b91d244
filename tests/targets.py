"""Run a test's op or graph on each target: the interpreter, and compiled C where a compiler exists."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Mapping

import numpy as np

import neoflow
from neoflow.ir import Graph, Op

TARGETS = ["interp", *(["cpu"] if shutil.which(os.environ.get("CC", "cc")) else [])]


def evaluate_on(target: str, program: Op | Graph, inputs: Mapping[str, np.ndarray]):
    """``neoflow.evaluate`` on ``target``: an op's output array, or a graph's outputs by name."""
    if target == "interp":
        return neoflow.evaluate(program, inputs)
    if isinstance(program, Graph):
        program = dataclasses.replace(program, source_names={})  # inputs and outputs by graph names
    return neoflow.compile(program, target=target).run(inputs)
