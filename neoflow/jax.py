"""neoflow ops as JAX functions (the optional extra ``neoflow[jax]``).

    import neoflow.jax
    caps = neoflow.jax.op("Out[b, k, p, q, i, j] = ReduceAdd({c, r, s, t}, "
                          "In[b, c, p*2 + r, q*2 + s, i, t] * W[k, c, r, s, t, j])")
    y = caps(x, w)                                   # jax arrays in, a jax array out
    gx, gw = jax.grad(lambda x, w: caps(x, w).sum(), argnums=(0, 1))(x, w)

Each op is a ``jax.custom_vjp`` function: its forward and its backward (the derived gather-form adjoints)
run the kernels neoflow compiles for the ``cpu`` target, through ``jax.pure_callback``, so it works under
``jax.jit``, ``jax.grad``, ``jax.vjp`` and ``jax.vmap`` (one call per batch element).  Inputs bind by
position (the order the expression first reads them) or by name; shapes come from the arrays when JAX
traces the function, and the kernels are compiled once per shape and dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from neoflow.runtime.expression_op import ExpressionOp

__all__ = ["JaxOp", "op"]


def op(expression: str, fusion: str = "neoflow") -> JaxOp:
    """The tensor expression ``expression`` (one statement) as a differentiable JAX function."""
    return JaxOp(expression, fusion)


class JaxOp:
    """``expression`` as a ``jax.custom_vjp`` function over neoflow's compiled kernels.  ``inputs``: the
    input names in call order; ``output``: the output's name."""

    def __init__(self, expression: str, fusion: str = "neoflow") -> None:
        self.expression_op = ExpressionOp(expression, fusion)
        self.expression = expression
        self.output, self.inputs = self.expression_op.output, self.expression_op.inputs
        self._function = _custom_vjp(self)

    def __call__(self, *args: jax.Array, **kwargs: jax.Array) -> jax.Array:
        """The op's output: arrays by position (``inputs`` order) or by name."""
        return self._function(*self.expression_op.bind(args, kwargs))

    def signature(self, arrays: Sequence[object]) -> tuple[list[tuple[int, ...]], list[str]]:
        """Shapes and dtype names of (abstract or concrete) arrays."""
        return [tuple(a.shape) for a in arrays], [np.dtype(a.dtype).name for a in arrays]

    def output_struct(self, arrays: Sequence[object]) -> jax.ShapeDtypeStruct:
        """The output's shape and dtype, for ``pure_callback``."""
        parsed = self.expression_op.parsed(*self.signature(arrays))
        return jax.ShapeDtypeStruct(parsed.shape, np.dtype(parsed.dtype))

    def run_forward(self, *arrays: np.ndarray) -> np.ndarray:
        """The forward callback: compile (once) and run on host arrays."""
        compiled = self.expression_op.compiled(*self.signature(arrays), "cpu", False)
        return np.asarray(compiled.run(dict(zip(self.inputs, map(np.asarray, arrays), strict=True))))

    def run_backward(self, wanted: tuple[str, ...], grad: np.ndarray, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        """The backward callback: the adjoints of the inputs ``wanted``, in that order."""
        compiled = self.expression_op.compiled(*self.signature(arrays), "cpu", True)
        given = dict(zip(self.inputs, map(np.asarray, arrays), strict=True))
        results = compiled.backward(given, {f"d{self.output}": np.asarray(grad)}, wrt=wanted)
        return tuple(np.asarray(results[n]) for n in wanted)


def _custom_vjp(layer: JaxOp) -> Callable:
    """The ``jax.custom_vjp`` function of ``layer``: forward and backward through ``pure_callback``."""

    def forward(*arrays: jax.Array) -> jax.Array:
        return jax.pure_callback(layer.run_forward, layer.output_struct(arrays), *arrays, vmap_method="sequential")

    function = jax.custom_vjp(forward)

    def forward_with_residuals(*arrays: jax.Array):
        return forward(*arrays), arrays

    def backward(arrays, grad: jax.Array):
        floats = [jax.numpy.issubdtype(a.dtype, jax.numpy.floating) for a in arrays]
        wanted = tuple(n for n, f in zip(layer.inputs, floats, strict=True) if f)
        structs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a, f in zip(arrays, floats, strict=True) if f)
        grads = iter(
            jax.pure_callback(
                lambda g, *a: layer.run_backward(wanted, g, *a), structs, grad, *arrays, vmap_method="sequential"
            )
        )
        return tuple(next(grads) if f else None for f in floats)

    function.defvjp(forward_with_residuals, backward)
    return function
