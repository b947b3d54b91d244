"""A sliced kernel in C: a group of ops run slice by slice along their batch, each thread its slices.

Each op is lowered (``lower_op``) over one slice (``fusion.slicing.slice_shapes``)
and called once a slice with its sliced tensors' pointers moved to the slice's
rows.  An op kept in a slice buffer writes, and its readers read, a block of the
thread's own one slice long (it never reaches memory); an op summing the batch
away writes each slice's partial sum to a scratch block, added to the thread's
partial sums; once every slice is done the threads' partial sums are added up
into the op's output.  Inside the slice loop every op runs on its thread alone:
its C is made serial (``one_thread``), as a nested parallel region of one thread
costs ~0.7 µs to open, a dozen times a slice.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping, Sequence

from neoflow.codegen.c_expr import c_type
from neoflow.errors import CompileError
from neoflow.fusion.slicing import ROWS, Role, roles_in_kernel, slice_shapes, slice_tensor
from neoflow.ir import dtypes as dt
from neoflow.ir.op import Op, Tensor
from neoflow.targets.cpu.lower import file_local, lower_op

ALIGN = 64
#: an OpenMP directive that opens a parallel region or shares out a loop among a team
_TEAM_DIRECTIVE = re.compile(r"\s*#pragma omp (parallel|for)\b")
#: what the thread queries return on the one thread an op runs on inside a slice
_ONE_THREAD = {"omp_get_thread_num()": "0", "omp_get_num_threads()": "1"}


def one_thread(source: str) -> str:
    """An op's C (``lower_op``) as its one thread runs it inside a slice: without its
    parallel regions and shared-out loops (each nested region, opened with its one
    thread, cost ~0.7 µs, on every slice: measured in a loop of 10^5 calls), the
    thread queries answering thread 0 of a team of one; its vector loops
    (``omp simd``) kept.  The same work in the same order as the team of one ran it."""
    kept = [line for line in source.split("\n") if not _TEAM_DIRECTIVE.match(line)]
    text = "\n".join(kept)
    for query, answer in _ONE_THREAD.items():
        text = text.replace(query, answer)
    return text


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def _bytes(tensor: Tensor | Op) -> int:
    return math.prod(tensor.shape) * dt.numpy_dtype(tensor.dtype).itemsize


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
    helpers, calls, totals = [], [], []
    buffer_at: dict[str, int] = {}  # offset of each slice buffer (and sum scratch) in the thread's block
    block = sums = 0  # bytes of a thread's block, and of its partial sums
    for k, op in enumerate(ops):
        role = roles[op.name]
        piece = slice_shapes(op, role, length)
        function = f"{name}_op{k}"
        # not inlined: gcc 12, inlining the ops' functions into the slice loop, moved a load through one
        # op's restrict pointer above the store through the op before's (the CNN step's max-pool read the
        # ReLU's output before the ReLU wrote it: tests/fusion/test_policies.py, the CNN training step)
        helpers.append(file_local(one_thread(lower_op(piece, function)), function, "__attribute__((noinline))"))
        arguments = [_pointer(t, role, private, buffer_at, slot, length) for t in op.inputs]
        if role.kind == ROWS and op.name not in private:
            calls.append(f"            {function}((void *)({_moved(slot[op.name], piece)}), {', '.join(arguments)});")
            continue
        buffer_at[op.name] = block
        block += _aligned(_bytes(piece))
        calls.append(f"            {function}((void *)(slice_ + {buffer_at[op.name]}), {', '.join(arguments)});")
        if role.kind == ROWS:
            continue
        # a sum: the slice's partial added to the thread's, the threads' added into the output at the end
        ctype, size = c_type(op.dtype), math.prod(op.shape)
        calls.append(
            f"            for (int64_t i = 0; i < {size}; ++i) "
            f"(({ctype} *)(mine_ + {sums}))[i] += (({ctype} *)(slice_ + {buffer_at[op.name]}))[i];"
        )
        totals.append(
            f"""    for (int64_t i = 0; i < {size}; ++i) {{
        {ctype} total = 0;
        for (int64_t t = 0; t < threads_; ++t) total += (({ctype} *)(sums_ + t * sum_bytes_ + {sums}))[i];
        (({ctype} *)b[{slot[op.name]}])[i] = total;
    }}"""
        )
        sums += _aligned(_bytes(piece))
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
    const int64_t sum_bytes_ = {max(sums, ALIGN)};  /* a thread's partial sums */
    NF_SCRATCH(char, sums_, threads_ * sum_bytes_);
    memset(sums_, 0, threads_ * sum_bytes_);
    #pragma omp parallel
    {{
#ifdef _OPENMP
        const int64_t me_ = omp_get_thread_num();
        omp_set_num_threads(1);
#else
        const int64_t me_ = 0;
#endif
        NF_SCRATCH(char, slice_, {max(block, ALIGN)});
        char *const mine_ = sums_ + me_ * sum_bytes_;
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


def _moved(slot: int, piece: Tensor | Op) -> str:
    """Tensor ``b[slot]`` moved to slice ``s_``'s rows, a slice being ``piece`` (its shape over one slice)."""
    return f"(char *)b[{slot}] + s_ * {_bytes(piece)}"


def _pointer(
    tensor: Tensor,
    role: Role,
    private: Collection[str],
    buffer_at: Mapping[str, int],
    slot: Mapping[str, int],
    length: int,
) -> str:
    """The argument an op of the loop gets for its input ``tensor``: the slice
    buffer of a private op, the slice's rows of a tensor read slice by slice,
    the whole tensor otherwise."""
    if tensor.name in private:
        return f"(const void *)(slice_ + {buffer_at[tensor.name]})"
    if tensor.name in role.sliced:
        return f"(const void *)({_moved(slot[tensor.name], slice_tensor(tensor, length))})"
    return f"(const void *)b[{slot[tensor.name]}]"
