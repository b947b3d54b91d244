"""The benchmarks' own checks (their timing is ``neoflow.runtime.timing``: tests/runtime/test_timing.py)."""

from __future__ import annotations


def test_the_gpu_operator_suite_matches_pytorch_on_the_cpu() -> None:
    import numpy as np
    import torch

    import neoflow
    from benchmarks.gpu_ops import operators

    cheap = {"gemv", "bilinear", "conv1d", "conv1d_transposed"}
    for operator in operators():
        op = neoflow.op(operator.text, shapes=operator.shapes, out_shape=operator.out_shape)
        rng = np.random.default_rng(0)
        arrays = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in operator.shapes.items()}
        with torch.no_grad():
            theirs = operator.torch({name: torch.from_numpy(a) for name, a in arrays.items()}).numpy()
        assert op.shape == theirs.shape, operator.name
        if operator.name in cheap:  # the same values (the convolutions' sizes are for a GPU)
            ours = neoflow.evaluate(op, arrays)
            assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max(), operator.name
