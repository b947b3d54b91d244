"""Index tables built by a kernel's first call and kept for the next ones."""

from __future__ import annotations

import threading

import numpy as np

import neoflow
from neoflow.targets.cpu.lower import lower_op
from neoflow.targets.cpu.tables import built_once, index_table
from tests.on_targets import NEEDS_CC


def _strided_conv(width: int) -> neoflow.Op:
    """A stride-2 convolution (the blocked kernel, its tables and packers) of a size no other test uses."""
    return neoflow.op(
        "Y[n, k, p, q] = ReduceAdd({r, s, c}, X[n, c, 2*p + r, 2*q + s] * W[k, c, r, s])",
        shapes={"X": (1, 3, 2 * width + 1, 2 * width + 1), "W": (24, 3, 3, 3)},
    )


def _inputs(op: neoflow.Op, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in op.inputs}


def test_tables_are_declared_static_and_built_under_a_flag_and_a_lock() -> None:
    code = built_once([index_table("row", [("i", 4), ("j", 3)], "v_i * 3 + v_j")])
    assert "static int32_t *row_tab; static int64_t *row_off;" in code
    build = code.index("row_tab = (int32_t *)malloc")
    assert code.index("__atomic_test_and_set(&tables_lock_") < build < code.index("__atomic_store_n(&tables_built_, 1")
    assert "free(" not in code, "the tables are kept for the next call"


@NEEDS_CC
def test_a_blocked_kernel_called_again_on_other_inputs_gives_their_result() -> None:
    op = _strided_conv(21)
    assert "static int tables_built_;" in lower_op(op, "kernel")
    model = neoflow.compile(op, target="cpu")
    for seed in (1, 2, 3):
        inputs = _inputs(op, seed)
        expected = neoflow.evaluate(op, inputs)
        np.testing.assert_allclose(model.run(inputs), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@NEEDS_CC
def test_threads_calling_a_kernel_first_at_once_each_get_their_result() -> None:
    # a size no other test compiles: the library's first calls are these, made at once
    op = _strided_conv(23)
    model = neoflow.compile(op, target="cpu")
    inputs = [_inputs(op, seed) for seed in range(4)]
    results: list = [None] * len(inputs)
    start = threading.Barrier(len(inputs))

    def run(k: int) -> None:
        start.wait()
        results[k] = model.run(inputs[k])

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for given, got in zip(inputs, results, strict=True):
        expected = neoflow.evaluate(op, given)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
