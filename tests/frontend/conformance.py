"""Run onnx's backend test runner (``onnx.backend.test.BackendTest``) with
``neoflow.backend`` over the generated node tests of the op types issue 4 lists.

    python -m tests.frontend.conformance        # prints the pass rate and every failure
"""

from __future__ import annotations

import re
import unittest
from pathlib import Path

import onnx.backend.test
import onnx.backend.test.runner as runner_module
from onnx.backend.test.loader import load_model_tests

import neoflow.backend

from .onnx_node_data import OP_TYPES, node_data_dir, op_type_of


def selected_cases() -> tuple[Path, list[str]]:
    """The data directory and the node test names whose op type is in the list."""
    data = node_data_dir()
    names = sorted(p.name for p in (data / "node").iterdir() if p.is_dir() and op_type_of(p) in OP_TYPES)
    return data, names


def run() -> tuple[int, list[tuple[str, str]]]:
    """Run the selected node tests; returns (number run, [(test, reason) for failures])."""
    data, names = selected_cases()
    original = runner_module.load_model_tests
    runner_module.load_model_tests = lambda data_dir=None, kind=None: (
        load_model_tests(data_dir=str(data), kind="node") if kind == "node" else []
    )
    try:
        backend_test = onnx.backend.test.BackendTest(neoflow.backend, __name__)
    finally:
        runner_module.load_model_tests = original
    backend_test.include("^(" + "|".join(re.escape(n) for n in names) + ")_cpu$")
    suite = unittest.TestSuite()
    for case in backend_test.test_cases.values():
        suite.addTests(unittest.defaultTestLoader.loadTestsFromTestCase(case))
    result = unittest.TestResult()
    suite.run(result)
    failures = [(test.id().split(".")[-1], _reason(text)) for test, text in result.failures + result.errors]
    return result.testsRun - len(result.skipped), failures


def _reason(traceback_text: str) -> str:
    lines = [line for line in traceback_text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "?"


if __name__ == "__main__":
    total, failed = run()
    for name, reason in failed:
        print(f"FAIL {name}: {reason}")
    print(f"{total - len(failed)} of {total} node tests pass ({(total - len(failed)) / max(total, 1):.1%})")
