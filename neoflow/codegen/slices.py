"""A sliced kernel in C: a group of ops run slice by slice along their batch, each thread its slices.

Each op is lowered (``lower_op``) over one slice (``fusion.slicing.slice_shapes``)
and called once a slice with its sliced tensors' pointers moved to the slice's
rows.  An op kept in a slice buffer writes, and its readers read, a block of the
thread's own one slice long (it never reaches memory); an op summing the batch
away writes each slice's partial sum to a scratch block, added to the thread's
partial sums; once every slice is done the threads' partial sums are added up
into the op's output.  Inside the slice loop every op runs on its thread alone
(nested parallel regions get one thread).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from neoflow.codegen.c_expr import c_type
from neoflow.codegen.lower import lower_op
from neoflow.errors import CompileError
from neoflow.fusion.slicing import ROWS, Role, roles_in_kernel, slice_shapes
from neoflow.ir import dtypes as dt
from neoflow.ir.op import Op

ALIGN = 64


@dataclass(frozen=True)
class SliceRun:
    """A fusion plan's sliced kernel as the executor runs it: its fused ``ops`` (in
    order), ``length`` rows a slice, and the ops kept in slice buffers (``private``)."""

    ops: tuple[str, ...]
    length: int
    private: tuple[str, ...] = ()


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def _bytes(shape: Sequence[int], dtype: str) -> int:
    return math.prod(shape) * dt.numpy_dtype(dtype).itemsize


def sliced_function(
    ops: Sequence[Op], length: int, private: Collection[str], slot: Mapping[str, int], name: str
) -> str:
    """C function ``name(void *const *b)`` running ``ops`` slice by slice, ``length``
    rows a slice, tensor ``t`` at ``b[slot[t]]``; the ``private`` ops live in slice
    buffers.  Raises ``CompileError`` when the ops cannot run so (their roles) or an
    op has no C lowering."""
    roles = roles_in_kernel(ops, private)
    if isinstance(roles, str):
        raise CompileError(f"cannot run slice by slice: {roles}")
    batch = next(iter(roles.values())).batch
    if batch % length:
        raise CompileError(f"slices of {length} rows do not split {batch} rows")
    helpers, calls = [], []
    buffer_at: dict[str, int] = {}  # offset of each slice buffer (and sum scratch) in the thread's block
    sum_at: dict[str, int] = {}  # offset of each sum's partials in the thread's block of them
    block = sums = 0
    for k, op in enumerate(ops):
        role = roles[op.name]
        piece = slice_shapes(op, role, length)
        function = f"{name}_op{k}"
        # not inlined: gcc 12, inlining the ops' functions into the slice loop, moved a load through one
        # op's restrict pointer above the store through the op before's (a max-pool read the ReLU's
        # buffer before the ReLU wrote it: tests/fusion/test_slicing.py, the CNN's training step)
        helpers.append(
            lower_op(piece, function).replace(
                f"void {function}(", f"__attribute__((noinline)) static void {function}(", 1
            )
        )
        arguments = [_pointer(t.name, t.shape, t.dtype, role, private, buffer_at, slot, length) for t in op.inputs]
        if role.kind == ROWS and op.name in private:
            buffer_at[op.name] = block
            block += _aligned(_bytes(piece.shape, op.dtype))
            output = f"slice_ + {buffer_at[op.name]}"
        elif role.kind == ROWS:
            output = _moved(f"b[{slot[op.name]}]", _bytes(piece.shape, op.dtype))
        else:
            buffer_at[op.name], sum_at[op.name] = block, sums
            block += _aligned(_bytes(op.shape, op.dtype))
            sums += _aligned(_bytes(op.shape, op.dtype))
            output = f"slice_ + {buffer_at[op.name]}"
        calls.append(f"            {function}((void *)({output}), {', '.join(arguments)});")
        if role.kind != ROWS:
            ctype = c_type(op.dtype)
            calls.append(
                f"            for (int64_t i = 0; i < {math.prod(op.shape)}; ++i) "
                f"(({ctype} *)(mine_ + {sum_at[op.name]}))[i] += (({ctype} *)(slice_ + {buffer_at[op.name]}))[i];"
            )
    totals = []
    for op in ops:
        if op.name in sum_at:
            ctype = c_type(op.dtype)
            totals.append(
                f"""    for (int64_t i = 0; i < {math.prod(op.shape)}; ++i) {{
        {ctype} total = 0;
        for (int64_t t = 0; t < threads_; ++t) total += (({ctype} *)(sums_ + t * {sums} + {sum_at[op.name]}))[i];
        (({ctype} *)b[{slot[op.name]}])[i] = total;
    }}"""
            )
    body = "\n".join(calls)
    return (
        "\n\n".join(helpers)
        + f"""

void {name}(void *const *b) {{
#ifdef _OPENMP
    const int64_t threads_ = omp_get_max_threads();
#else
    const int64_t threads_ = 1;
#endif
    NF_SCRATCH(char, sums_, threads_ * {max(sums, ALIGN)});
    memset(sums_, 0, threads_ * {max(sums, ALIGN)});
    #pragma omp parallel
    {{
#ifdef _OPENMP
        const int64_t me_ = omp_get_thread_num();
        omp_set_num_threads(1);
#else
        const int64_t me_ = 0;
#endif
        NF_SCRATCH(char, slice_, {max(block, ALIGN)});
        char *const mine_ = sums_ + me_ * {max(sums, ALIGN)};
        (void)mine_;
        #pragma omp for schedule(static)
        for (int64_t s_ = 0; s_ < {batch // length}; ++s_) {{
{body}
        }}
    }}
{chr(10).join(totals)}
}}
"""
    )


def _moved(pointer: str, slice_bytes: int) -> str:
    """``pointer`` moved to slice ``s_``'s rows, a slice being ``slice_bytes`` long."""
    return f"(char *){pointer} + s_ * {slice_bytes}"


def _pointer(
    tensor: str,
    shape: Sequence[int],
    dtype: str,
    role: Role,
    private: Collection[str],
    buffer_at: Mapping[str, int],
    slot: Mapping[str, int],
    length: int,
) -> str:
    """The argument an op of the loop gets for its input ``tensor``: the slice
    buffer of a private op, the slice's rows of a tensor read slice by slice,
    the whole tensor otherwise."""
    if tensor in private:
        return f"(const void *)(slice_ + {buffer_at[tensor]})"
    if tensor in role.sliced:
        return f"(const void *)({_moved(f'b[{slot[tensor]}]', _bytes((length, *shape[1:]), dtype))})"
    return f"(const void *)b[{slot[tensor]}]"
