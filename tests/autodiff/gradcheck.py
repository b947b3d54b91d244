"""Check adjoints against float64 central finite differences (and PyTorch where given)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping

import numpy as np

import neoflow
from neoflow.autodiff import grad
from neoflow.ir import Op

FD_STEP = 1e-6
TOLERANCE = 1e-6


def random_inputs(op: Op, seed: int = 0, positive: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Standard normal inputs (uniform in [0.5, 1.5] for names in ``positive``)."""
    rng = np.random.default_rng(seed)
    inputs = {}
    for t in op.inputs:
        if t.dtype.startswith("int"):
            continue
        inputs[t.name] = rng.uniform(0.5, 1.5, t.shape) if t.name in positive else rng.standard_normal(t.shape)
    return inputs


def adjoints(op: Op, inputs: Mapping[str, np.ndarray], dout: np.ndarray, wrt=None) -> dict[str, np.ndarray]:
    """Evaluate every adjoint of ``op`` with the interpreter."""
    values = dict(inputs)
    values[f"d{op.name}"] = dout
    values[op.name] = neoflow.evaluate(op, inputs)
    out = {}
    for name, adj in grad(op, wrt).items():
        out[name] = neoflow.evaluate(adj, {t.name: values[t.name] for t in adj.inputs})
    return out


def finite_difference(op: Op, inputs: Mapping[str, np.ndarray], dout: np.ndarray, name: str) -> np.ndarray:
    """d sum(dout * op(inputs)) / d inputs[name], by central differences."""
    x = inputs[name]
    result = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        total = []
        for step in (FD_STEP, -FD_STEP):
            moved = x.copy()
            moved[i] += step
            total.append(float((neoflow.evaluate(op, {**inputs, name: moved}) * dout).sum()))
        result[i] = (total[0] - total[1]) / (2 * FD_STEP)
    return result


def relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    """max |got - expected| / max |expected|."""
    return float(np.abs(got - expected).max() / max(np.abs(expected).max(), 1e-12))


def check(
    text: str,
    shapes: Mapping[str, tuple[int, ...]],
    torch_fn: Callable[..., object] | None = None,
    positive: tuple[str, ...] = (),
    dtypes: Mapping[str, str] | None = None,
    wrt=None,
    seed: int = 0,
) -> Op:
    """Parse ``text`` in float64, derive its adjoints and check each against finite
    differences and, when ``torch_fn`` is given, against PyTorch autograd
    (``torch_fn(**tensors)`` computes the same output).  Asserts every adjoint is a
    gather with zero waste.  Returns the op."""
    op = neoflow.op(text, shapes=shapes, dtype="float64", dtypes=dtypes)
    inputs = random_inputs(op, seed, positive)
    for t in op.inputs:
        if t.name not in inputs:
            raise AssertionError(f"give integer input {t.name}")
    dout = np.random.default_rng(seed + 1).standard_normal(op.shape)
    got = adjoints(op, inputs, dout, wrt)
    for name, value in got.items():
        expected = finite_difference(op, inputs, dout, name)
        err = relative_error(value, expected)
        assert err < TOLERANCE, f"d{name}: relative error {err:.2e} against finite differences"
    if torch_fn is not None:
        import torch

        tensors = {k: torch.tensor(v, requires_grad=True) for k, v in inputs.items()}
        out = torch_fn(**tensors)
        np.testing.assert_allclose(out.detach().numpy(), neoflow.evaluate(op, inputs), rtol=1e-9, atol=1e-9)
        out.backward(torch.tensor(dout))
        for name, value in got.items():
            err = relative_error(value, tensors[name].grad.numpy())
            assert err < TOLERANCE, f"d{name}: relative error {err:.2e} against PyTorch"
    for name, adj in grad(op, wrt).items():
        assert adj.info.kind == "gather", f"d{name} is a {adj.info.kind}"
        assert adj.info.waste == 0.0, f"d{name} wastes {adj.info.waste:.1%}: {adj}"
    check_compiled(op, inputs, dout, got)
    return op


def check_compiled(
    op: Op, inputs: Mapping[str, np.ndarray], dout: np.ndarray, expected: Mapping[str, np.ndarray]
) -> None:
    """The op and its adjoints compiled for the cpu target give the interpreter's
    values (float64: to 1e-10 relative).  Skipped where there is no C compiler."""
    if shutil.which(os.environ.get("CC", "cc")) is None:
        return
    layer = neoflow.compile(op, target="cpu", grad=True)
    reference = neoflow.evaluate(op, inputs)
    assert relative_error(layer.run(inputs), reference) < 1e-10, "compiled forward differs from the interpreter"
    compiled = layer.backward(inputs, {f"d{op.name}": dout})
    for name, value in expected.items():
        err = relative_error(compiled[name], value)
        assert err < 1e-10, f"compiled d{name} differs from the interpreter by {err:.2e}"
