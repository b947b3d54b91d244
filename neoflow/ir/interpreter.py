"""The reference interpreter: evaluates ops and graphs with numpy.

It is the oracle for the rest of the compiler, so it is written to be plainly
right rather than fast.  An op is evaluated over a grid with one numpy axis per
output index and per reduction axis: each index variable is an ``arange``
shaped to broadcast along its own axis, reads are numpy gathers, and a
reduction combines its own axes.  Large grids are cut into chunks along the
output axes, so memory stays bounded.  Reads that a false ``Select`` condition
(or a short-circuited ``&&``/``||``) skips are clamped into bounds and never
used; a read that is used out of bounds is an error.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import numpy as np

from neoflow.errors import InputError, ShapeError
from neoflow.ir import dtypes as dt
from neoflow.ir import index
from neoflow.ir.expr import Binary, Cast, Const, Expr, Index, Read, Reduce, Select, Unary
from neoflow.ir.graph import Graph
from neoflow.ir.op import Op, Tensor

#: Largest number of grid points evaluated at once.
CHUNK_POINTS = 1 << 26

Mask = np.ndarray | None  # None: every point is live


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


_erf = np.frompyfunc(math.erf, 1, 1)


def _erf_array(x: np.ndarray) -> np.ndarray:
    return _erf(x).astype(np.asarray(x).dtype)


_UNARY = {
    "erf": _erf_array,
    "-": np.negative,
    "!": np.logical_not,
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "tanh": np.tanh,
    "sigmoid": _sigmoid,
    "abs": np.abs,
}
_BINARY = {
    "+": np.add,
    "-": np.subtract,
    "*": np.multiply,
    "/": np.true_divide,
    "//": np.floor_divide,
    "%": np.mod,
    "pow": np.power,
    "max": np.maximum,
    "min": np.minimum,
    "<": np.less,
    "<=": np.less_equal,
    ">": np.greater,
    ">=": np.greater_equal,
    "==": np.equal,
    "!=": np.not_equal,
}


def reduction_identity(kind: str, dtype: np.dtype) -> int | float:
    """The value a reduction of ``kind`` over ``dtype`` starts from (and gives when empty)."""
    if kind in ("ReduceAdd", "ReduceMul"):
        return 0 if kind == "ReduceAdd" else 1
    if np.issubdtype(dtype, np.floating):
        return -np.inf if kind == "ReduceMax" else np.inf
    info = np.iinfo(dtype) if np.issubdtype(dtype, np.integer) else None
    if info is None:
        return kind == "ReduceMin"
    return info.min if kind == "ReduceMax" else info.max


class _OpEvaluator:
    """Evaluates one op on one chunk of its output."""

    def __init__(self, op: Op, arrays: Mapping[str, np.ndarray]) -> None:
        self.op = op
        self.arrays = arrays
        self.extent = op.extent
        self.axes = list(dict.fromkeys([*op.indices, *op.reduce_axes]))
        self.rank = len(self.axes)
        self.chunk: dict[str, tuple[int, int]] = {}  # each index variable's range in the chunk evaluated
        # per read (by node), the index ranges of its gather and the gather: this chunk's, and the last one's
        self.gathered: dict[int, tuple[tuple, np.ndarray]] = {}
        self.earlier: dict[int, tuple[tuple, np.ndarray]] = {}

    def grid(self, name: str, start: int, stop: int) -> np.ndarray:
        shape = [1] * self.rank
        shape[self.axes.index(name)] = stop - start
        return np.arange(start, stop, dtype=np.int64).reshape(shape)

    def run(self, chunk: tuple[slice, ...]) -> np.ndarray:
        env = {name: self.grid(name, s.start, s.stop) for name, s in zip(self.op.indices, chunk, strict=True)}
        for axis in self.axes[len(self.op.indices) :]:
            env[axis] = self.grid(axis, 0, self.extent[axis])
        self.env = env
        self.chunk = {name: (s.start, s.stop) for name, s in zip(self.op.indices, chunk, strict=True)}
        self.chunk |= {axis: (0, self.extent[axis]) for axis in self.axes[len(self.op.indices) :]}
        self.earlier, self.gathered = self.gathered, {}
        with np.errstate(all="ignore"):
            target = dt.numpy_dtype(self.op.dtype)
            value = np.asarray(self.eval(self.op.body, None, target), dtype=target)
        if value.ndim:  # full rank; the reduction axes have been reduced to size 1
            value = value.reshape(value.shape[: len(self.op.indices)])
        return np.broadcast_to(value, tuple(s.stop - s.start for s in chunk))

    def targets(self, exprs: tuple) -> list[np.ndarray]:
        """Scatter target indices on the current chunk, without the reduction axes."""
        n_out = len(self.op.indices)
        out = []
        for expr in exprs:
            value = np.asarray(index.evaluate(expr, self.env, self.read_data))
            out.append(value.reshape(value.shape[:n_out]) if value.ndim else value)
        return out

    def eval(self, node: Expr, live: Mask, meets: np.dtype | None = None) -> np.ndarray:
        """``node``'s value where ``live`` (None: everywhere).  ``meets``: the dtype the value is
        converted to where it is used; a weakly typed float (a literal, or an expression of literals
        alone) is computed in it, as NumPy 2 and JAX treat Python scalars: ``X * 0.1`` multiplies a
        float64 ``X`` by the float64 nearest 0.1, not by the float32 one."""
        target = dt.numpy_dtype(node.dtype)
        if meets is not None and node.dtype == dt.WEAK_FLOAT and meets.name in dt.WIDE_FLOATS:
            target = meets
        if isinstance(node, Const):
            return np.asarray(node.value, dtype=target)
        if isinstance(node, Index):
            return np.asarray(index.evaluate(node.expr, self.env, self.read_data), dtype=np.int64)
        if isinstance(node, Read):
            indices = [np.asarray(index.evaluate(i, self.env, self.read_data)) for i in node.indices]
            return self.cached_gather(node, indices, live)
        if isinstance(node, Unary):
            work = target if node.dtype == dt.WEAK_FLOAT else dt.compute_dtype(node.dtype)
            x = self.eval(node.x, live, work)
            return _UNARY[node.op](x.astype(work, copy=False)).astype(target, copy=False)
        if isinstance(node, Binary):
            return self.binary(node, live, target)
        if isinstance(node, Select):
            cond = self.eval(node.cond, live).astype(bool, copy=False)
            a = self.eval(node.a, cond if live is None else live & cond, target)
            b = self.eval(node.b, ~cond if live is None else live & ~cond, target)
            return np.where(cond, a.astype(target, copy=False), b.astype(target, copy=False))
        if isinstance(node, Cast):
            return self.eval(node.x, live, target).astype(target)
        if isinstance(node, Reduce):
            return self.reduce(node, live, target)
        raise TypeError(f"cannot evaluate {type(node).__name__}")

    def binary(self, node: Binary, live: Mask, target: np.dtype) -> np.ndarray:
        if node.op in ("&&", "||"):
            a = self.eval(node.a, live).astype(bool, copy=False)
            go_on = a if node.op == "&&" else ~a
            b = self.eval(node.b, go_on if live is None else live & go_on).astype(bool, copy=False)
            return np.logical_and(a, b) if node.op == "&&" else np.logical_or(a, b)
        operand = _operand(node, target)
        a = self.eval(node.a, live, operand).astype(operand, copy=False)
        b = self.eval(node.b, live, operand).astype(operand, copy=False)
        result = target if node.dtype == dt.WEAK_FLOAT else dt.numpy_dtype(node.dtype)
        return _BINARY[node.op](a, b).astype(result, copy=False)

    def contract(self, node: Reduce, live: Mask, target: np.dtype) -> np.ndarray | None:
        """``ReduceAdd`` of a product of two factors, by ``np.einsum`` (no product grid)."""
        body = node.body
        if node.kind != "ReduceAdd" or node.where is not None or not isinstance(body, Binary) or body.op != "*":
            return None
        operand = _operand(body, target)
        a = self.eval(body.a, live, operand).astype(operand, copy=False)
        b = self.eval(body.b, live, operand).astype(operand, copy=False)
        if a.ndim != self.rank or b.ndim != self.rank or self.rank > 52:
            return None
        positions = {self.axes.index(axis) for axis in node.axes}
        letters = [chr(ord("a") + i) if i < 26 else chr(ord("A") + i - 26) for i in range(self.rank)]
        kept = "".join(letters[i] for i in range(self.rank) if i not in positions)
        # reduced axes that neither factor spans still count their extent
        scale = math.prod(self.extent[self.axes[p]] for p in positions if a.shape[p] == 1 and b.shape[p] == 1)
        out = np.einsum(f"{''.join(letters)},{''.join(letters)}->{kept}", a, b)
        if scale != 1:
            out = out * scale
        return np.expand_dims(out, tuple(sorted(positions))).astype(target, copy=False)

    def reduce(self, node: Reduce, live: Mask, target: np.dtype) -> np.ndarray:
        contracted = self.contract(node, live, target)
        if contracted is not None:
            return contracted
        initial = reduction_identity(node.kind, target)
        if node.where is None:
            body = self.eval(node.body, live, target).astype(target, copy=False)
        else:
            inside = self.eval(node.where, live).astype(bool, copy=False)
            body = self.eval(node.body, inside if live is None else live & inside, target).astype(target, copy=False)
            body = np.where(inside, body, np.asarray(initial, dtype=target))
        positions = tuple(self.axes.index(a) for a in node.axes)
        shape = list(np.shape(body)) + [1] * (self.rank - np.ndim(body))
        body = body.reshape(shape) if np.ndim(body) != self.rank else body
        for p in positions:
            shape[p] = self.extent[self.axes[p]]
        body = np.broadcast_to(body, shape)
        combine = {"ReduceAdd": np.sum, "ReduceMul": np.prod, "ReduceMax": np.max, "ReduceMin": np.min}[node.kind]
        return combine(body, axis=positions, keepdims=True, initial=initial).astype(target, copy=False)

    def cached_gather(self, node: Read, indices: list[np.ndarray], live: Mask) -> np.ndarray:
        """``gather`` of ``node`` at ``indices``, taken from the chunk before where the index
        variables it reads over span the same ranges (a convolution's input window, the same for
        every chunk of output channels, is gathered once): its bounds still checked where ``live``.
        A read's gather from the chunk before is released before it is gathered anew."""
        over = {name for i in node.indices for name in index.variables(i)}
        ranges = tuple(sorted((name, self.chunk[name]) for name in over))
        before = self.earlier.pop(id(node), None)  # released before a new gather
        if before is not None and before[0] == ranges:
            found = before[1]
            self.check_bounds(node.tensor, indices, live, node)
        else:
            found = self.gather(node.tensor, indices, live, node)
        self.gathered[id(node)] = (ranges, found)
        return found

    def read_data(self, tensor: str, indices: tuple[np.ndarray, ...]) -> np.ndarray:
        return self.gather(tensor, list(indices), None, None).astype(np.int64)

    def check_bounds(self, tensor: str, indices: list[np.ndarray], live: Mask, node: Read | None) -> bool:
        """Whether some of ``indices`` fall outside ``tensor`` (raising where such a read's value
        is used: where ``live``)."""
        array = self.arrays[tensor]
        outside = None
        for dim, idx in enumerate(indices):
            bad = (idx < 0) | (idx >= array.shape[dim])
            if bad.any():
                outside = bad if outside is None else outside | bad
        if outside is None:
            return False
        used = outside if live is None else outside & live
        if used.any():
            text = tensor if node is None else f"{tensor}[{', '.join(index.to_text(i) for i in node.indices)}]"
            raise ShapeError(f"read {text} is out of bounds where its value is used", op=self.op.name)
        return True

    def gather(self, tensor: str, indices: list[np.ndarray], live: Mask, node: Read | None) -> np.ndarray:
        array = self.arrays[tensor]
        if self.check_bounds(tensor, indices, live, node):
            indices = [np.clip(idx, 0, n - 1) for idx, n in zip(indices, array.shape, strict=True)]
        # pad every index to full rank so the gather broadcasts over the grid
        full = [i.reshape(i.shape + (1,) * (self.rank - i.ndim)) if 0 < i.ndim < self.rank else i for i in indices]
        return array[tuple(full)] if full else array[()]


class _PointEvaluator(_OpEvaluator):
    """Evaluates an expression at given points: its index variables bound to arrays that
    broadcast together, a reduction standing for a value given (``reduction``)."""

    def __init__(self, owner: str, arrays: Mapping[str, np.ndarray], env, reduction) -> None:
        shape = np.broadcast_shapes(*(np.shape(v) for v in env.values())) if env else ()
        self.op = Tensor(owner, shape)  # only its name is read, in error messages
        self.shape = shape
        self.arrays = arrays
        self.rank = len(shape)
        self.env = {name: np.broadcast_to(np.asarray(v, dtype=np.int64), shape) for name, v in env.items()}
        self.value = reduction

    def cached_gather(self, node: Read, indices: list[np.ndarray], live: Mask) -> np.ndarray:
        return self.gather(node.tensor, indices, live, node)  # evaluated once: nothing to reuse

    def reduce(self, node: Reduce, live: Mask, target: np.dtype) -> np.ndarray:
        if self.value is None:
            raise TypeError("a reduction cannot be evaluated at points")
        return np.asarray(self.value).astype(target, copy=False)


def _operand(node: Binary, target: np.dtype) -> np.dtype:
    """The dtype ``node``'s operands are computed in: its operand dtype's, or, where that is a weak
    float (literals alone), ``target``, the dtype its value meets."""
    if node.operand_dtype == dt.WEAK_FLOAT and target.name in dt.WIDE_FLOATS:
        return target
    return dt.compute_dtype(node.operand_dtype)


def evaluate_at(
    expr: Expr,
    env: Mapping[str, np.ndarray],
    arrays: Mapping[str, np.ndarray],
    owner: str,
    live: np.ndarray | None = None,
    reduction: np.ndarray | None = None,
) -> np.ndarray:
    """``expr`` at the points ``env`` gives (index variable -> int array; the arrays broadcast
    together), reading ``arrays``; where ``live`` is false the value is unused and its reads
    may be out of bounds; any reduction in ``expr`` stands for ``reduction`` (a value per
    point: a kernel's accumulators, say).  The interpreter's semantics exactly, per point."""
    evaluator = _PointEvaluator(owner, arrays, env, reduction)
    with np.errstate(all="ignore"):
        value = evaluator.eval(expr, None if live is None else np.broadcast_to(live, evaluator.shape))
    return np.asarray(value, dtype=dt.numpy_dtype(expr.dtype))


def _chunks(shape: tuple[int, ...], per_point: int) -> Iterator[tuple[slice, ...]]:
    """Slices covering ``shape`` with at most ``CHUNK_POINTS`` grid points each
    (never less than one output point)."""

    def cover(prefix: tuple[slice, ...], axis: int) -> Iterator[tuple[slice, ...]]:
        rest = math.prod(shape[axis + 1 :]) * per_point
        whole = tuple(slice(0, n) for n in shape[axis + 1 :])
        if axis == len(shape) or shape[axis] * rest <= CHUNK_POINTS:
            yield (*prefix, *(slice(0, n) for n in shape[axis:]))
        elif rest <= CHUNK_POINTS:
            block = CHUNK_POINTS // rest
            for start in range(0, shape[axis], block):
                yield (*prefix, slice(start, min(start + block, shape[axis])), *whole)
        else:
            for i in range(shape[axis]):
                yield from cover((*prefix, slice(i, i + 1)), axis + 1)

    yield from cover((), 0)


def check_inputs(
    tensors: tuple[Tensor, ...], inputs: Mapping[str, np.ndarray], owner: str, as_is=None
) -> dict[str, np.ndarray]:
    """``inputs`` for ``tensors``: each present, of the right shape, converted to its dtype;
    values ``as_is(value)`` holds for (a GPU target's device arrays) pass unconverted, their
    shape checked."""
    require_mapping(inputs, "inputs", owner)
    arrays = {}
    for tensor in tensors:
        if tensor.name not in inputs:
            raise InputError(f"missing input '{tensor.name}' (expected shape {list(tensor.shape)})", op=owner)
        value = inputs[tensor.name]
        if as_is is not None and as_is(value):
            if tuple(value.shape) != tensor.shape:
                raise InputError(
                    f"input '{tensor.name}' has shape {list(value.shape)}, expected {list(tensor.shape)}", op=owner
                )
            arrays[tensor.name] = value
            continue
        arrays[tensor.name] = input_array(value, tensor, f"input '{tensor.name}'", owner)
    return arrays


def require_mapping(given: object, what: str, owner: str | None = None) -> None:
    """An ``InputError`` unless ``given`` (a caller's ``what``: inputs, a batch) maps names to arrays."""
    if not isinstance(given, Mapping):
        raise InputError(f"{what} must be a mapping of input names to arrays, got {type(given).__name__}", op=owner)


def input_array(value: object, tensor: Tensor, what: str, owner: str | None = None) -> np.ndarray:
    """``value`` as a host array of ``tensor``'s dtype, checked first: its shape, and that it holds
    numbers its dtype can take (no strings, objects or complex numbers; no floats for an integer
    tensor); ``what`` names it in the ``InputError``."""
    try:
        array = np.asarray(value)
    except (TypeError, ValueError, RuntimeError) as err:  # a GPU tensor for a host target, say
        raise InputError(f"{what} cannot be read as a host array ({err})", op=owner) from None
    if array.shape != tensor.shape:
        raise InputError(f"{what} has shape {list(array.shape)}, expected {list(tensor.shape)}", op=owner)
    target = dt.numpy_dtype(tensor.dtype)
    accepted = "biuf" if dt.is_float(tensor.dtype) else "biu"  # floats are not silently truncated to integers
    if array.dtype != target and array.dtype.kind not in accepted:
        raise InputError(f"{what} holds {array.dtype} values, expected {tensor.dtype}", op=owner)
    return array.astype(target, copy=False)


def evaluate_op(op: Op, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """Evaluate ``op`` on ``inputs`` (arrays by tensor name); returns its output.

    Inputs are converted to the dtype the op declares for them; a missing input
    or a wrong shape raises ``InputError``."""
    arrays = check_inputs(op.inputs, inputs, op.name)
    return _evaluate(op, arrays)


def _evaluate(op: Op, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    dtype = dt.numpy_dtype(op.dtype)
    evaluator = _OpEvaluator(op, arrays)
    per_point = math.prod(op.extent[a] for a in set(op.reduce_axes))
    space = tuple(op.extent[v] for v in op.indices)
    out = np.zeros(op.shape, dtype) if op.scatter is not None else np.empty(op.shape, dtype)
    for chunk in _chunks(space, max(per_point, 1)):
        values = evaluator.run(chunk)
        if op.scatter is None:
            out[chunk] = values
            continue
        target = [np.broadcast_to(np.asarray(i, dtype=np.int64), values.shape) for i in evaluator.targets(op.scatter)]
        for dim, idx in enumerate(target):
            if ((idx < 0) | (idx >= op.shape[dim])).any():
                raise ShapeError(f"scatter target index {dim} leaves '{op.name}' (size {op.shape[dim]})", op=op.name)
        np.add.at(out, tuple(target), values)
    return out


def evaluate_graph(graph: Graph, inputs: Mapping[str, np.ndarray], keep: bool = False) -> dict[str, np.ndarray]:
    """Evaluate ``graph``; returns its outputs by name (every tensor if ``keep``)."""
    values = check_inputs(graph.inputs, {**graph.parameters, **inputs}, "graph")
    for op in graph.ops:
        values[op.name] = _evaluate(op, values)
    names = list(values) if keep else graph.outputs
    return {name: values[name] for name in names}


def evaluate(target: Op | Graph, inputs: Mapping[str, np.ndarray]) -> np.ndarray | dict[str, np.ndarray]:
    """Evaluate an op (returns its output array) or a graph (returns a dict of outputs)."""
    if isinstance(target, Graph):
        return evaluate_graph(target, inputs)
    return evaluate_op(target, inputs)
