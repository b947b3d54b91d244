"""CUDA C++ from kernel plans: ``mma.sync`` implicit-GEMM kernels and SIMT kernels.

Every kernel is ``extern "C"``; its parameters are the output, then the op's inputs
in order.  Expressions are printed by the shared C-syntax printers
(``codegen.c_expr``) with CUDA's types; the tile and fragment formulas come from
``plan`` (the tensor-core model evaluates the same ones).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import sympy

from neoflow.codegen.c_expr import C_TYPES, IndexPrinter, ValuePrinter, c_type, unflatten_index
from neoflow.codegen.gather import OFFSET, Gather, map_reads
from neoflow.codegen.lattice import with_reduce
from neoflow.codegen.strided import loop_order
from neoflow.errors import CompileError
from neoflow.ir import dtypes as dt
from neoflow.ir import index
from neoflow.ir.expr import (
    LOGICAL,
    Binary,
    Const,
    Expr,
    Index,
    Read,
    Reduce,
    Select,
    bound_variables,
    index_variables,
    reductions,
)
from neoflow.ir.op import Op, Tensor, rename_in_expression
from neoflow.targets.cuda.plan import (
    ATOM_BYTES,
    ELEMENT,
    REG,
    VEC,
    WGMMA_K,
    MmaKernel,
    OpPlan,
    SimtKernel,
    accumulator_coords,
    ldmatrix_a_address,
    ldmatrix_b_address,
    reduction_parts,
    tf32_a_coords,
    tf32_b_coords,
)

#: C types in CUDA C++: C's, but CUDA's 16-bit floats and C++'s bool
CUDA_TYPES = {**C_TYPES, "float16": "__half", "bfloat16": "__nv_bfloat16", "bool": "bool"}

PRELUDE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#define INT64_C(x) x##LL
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef NAN
#define NAN __int_as_float(0x7fffffff)
#endif
/* Python's floor division and modulo, in the wider of the two operands' integer types */
template <typename A, typename B> static __device__ __forceinline__ auto nf_fdiv(A a, B b) -> decltype(a + b) {
    typedef decltype(a + b) T;
    if (b == 0) return 0;
    T q = (T)a / (T)b;
    return ((T)a % (T)b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
template <typename A, typename B> static __device__ __forceinline__ auto nf_mod(A a, B b) -> decltype(a + b) {
    typedef decltype(a + b) T;
    if (b == 0) return 0;
    T r = (T)a % (T)b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + (T)b : r;
}
static __device__ __forceinline__ double nf_fmod(double a, double b) {
    double r = fmod(a, b);
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
static __device__ __forceinline__ int64_t nf_ipow(int64_t a, int64_t b) {
    int64_t r = 1;
    if (b < 0) return 0;
    while (b) { if (b & 1) r *= a; a *= a; b >>= 1; }
    return r;
}
static __device__ __forceinline__ float nf_pickf(int c, float a, float b) { return c ? a : b; }
static __device__ __forceinline__ double nf_pick(int c, double a, double b) { return c ? a : b; }
#define NF_FMAX(a, b) (((a) != (a) || (a) > (b)) ? (a) : (b))
#define NF_FMIN(a, b) (((a) != (a) || (a) < (b)) ? (a) : (b))
#define NF_IMAX(a, b) ((a) > (b) ? (a) : (b))
#define NF_IMIN(a, b) ((a) < (b) ? (a) : (b))
/* a float rounded to tf32, to nearest even: one instruction on Hopper (cvt.rn; cvt.rna, ties away,
   is three there), the same rounding in integer arithmetic before it */
static __device__ __forceinline__ float nf_tf32(float x) {
#if __CUDA_ARCH__ >= 900
    uint32_t bits;
    asm("cvt.rn.tf32.f32 %0, %1;" : "=r"(bits) : "f"(x));
    return __uint_as_float(bits);
#else
    const uint32_t bits = __float_as_uint(x);
    if ((bits & 0x7f800000u) == 0x7f800000u) return x; /* inf, nan */
    return __uint_as_float((bits + 0xfffu + ((bits >> 13) & 1u)) & 0xffffe000u);
#endif
}
/* cp.async of BYTES (4, 8 or 16) bytes, zero-filled where the source is not valid; cached in L1
   (.ca): an implicit GEMM's gathers read an input element once per window tap, mostly within a block */
template <int BYTES> static __device__ __forceinline__ void nf_copy(void *shared, const void *global, bool valid) {
    const uint32_t address = (uint32_t)__cvta_generic_to_shared(shared);
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;"
                 :: "r"(address), "l"(global), "n"(BYTES), "r"(valid ? BYTES : 0));
}
static __device__ __forceinline__ void nf_copy_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> static __device__ __forceinline__ void nf_copy_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N));
}
static __device__ __forceinline__ void nf_ldmatrix_x4_trans(uint32_t *r, const void *p) {
    const uint32_t address = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}
/* Hopper wgmma (sm_90a): the 128-byte swizzle of a 16-bit element's place in a 1024-byte-aligned tile,
   a shared-memory matrix descriptor of such a tile (start, leading and stride byte offsets), and the
   fences and groups that order the asynchronous multiplies */
static __device__ __forceinline__ int nf_swz128(int e) { return e ^ (((e >> 6) & 7) << 3); }
static __device__ __forceinline__ uint64_t nf_desc(uint32_t address, uint32_t leading, uint32_t stride) {
    return (uint64_t)((address & 0x3FFFF) >> 4) | ((uint64_t)(leading >> 4) << 16)
        | ((uint64_t)(stride >> 4) << 32) | (1ull << 62);
}
static __device__ __forceinline__ void nf_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
static __device__ __forceinline__ void nf_wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N> static __device__ __forceinline__ void nf_wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
static __device__ __forceinline__ void nf_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
/* a 16-byte cp.async that skips L1 (a wgmma kernel's operand tiles are read once a block) */
static __device__ __forceinline__ void nf_copy_cg(void *shared, const void *global, bool valid) {
    const uint32_t address = (uint32_t)__cvta_generic_to_shared(shared);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(address), "l"(global), "r"(valid ? 16 : 0));
}
/* mbarriers handing shared-memory stages between a wgmma kernel's producer and its multiplying warpgroups */
static __device__ __forceinline__ void nf_bar_init(unsigned long long *bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;"
                 :: "r"((uint32_t)__cvta_generic_to_shared(bar)), "r"(count) : "memory");
}
static __device__ __forceinline__ void nf_bar_wait(unsigned long long *bar, int parity) {
    const uint32_t address = (uint32_t)__cvta_generic_to_shared(bar);
    uint32_t done;
    do {
#if __CUDA_ARCH__ >= 900
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(address), "r"(parity) : "memory");
#else  /* Ampere: no try_wait (which suspends the thread a while); test and test again */
        asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(address), "r"(parity) : "memory");
#endif
    } while (!done);
}
static __device__ __forceinline__ void nf_bar_arrive(unsigned long long *bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"((uint32_t)__cvta_generic_to_shared(bar)) : "memory");
#else  /* Ampere: the arrival's state into a register nobody reads */
    unsigned long long state;
    asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];"
                 : "=l"(state) : "r"((uint32_t)__cvta_generic_to_shared(bar)) : "memory");
#endif
}
/* arrive on BAR once every cp.async this thread issued before has landed */
static __device__ __forceinline__ void nf_bar_copies(unsigned long long *bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];"
                 :: "r"((uint32_t)__cvta_generic_to_shared(bar)) : "memory");
}
static __device__ __forceinline__ void nf_ldmatrix_x4(uint32_t *r, const void *p) {
    const uint32_t address = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}
"""

#: per storage dtype: the shared-memory type and the conversion of a float to it
_STORAGE = {
    "float16": ("__half", "__float2half_rn({})"),
    "bfloat16": ("__nv_bfloat16", "__float2bfloat16_rn({})"),
    "tf32": ("float", "nf_tf32({})"),
}
_MMA = {
    "float16": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
    "bfloat16": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    "tf32": "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32",
}
_IDENTITY = {"ReduceAdd": "0", "ReduceMul": "1", "ReduceMax": "(-INFINITY)", "ReduceMin": "INFINITY"}
_INT_IDENTITY = {"ReduceMax": "(-INT64_C(9223372036854775807) - 1)", "ReduceMin": "INT64_C(9223372036854775807)"}
_COMBINE = {"ReduceAdd": "{a} + {b}", "ReduceMul": "{a} * {b}"}


def _accumulator(node: Reduce) -> tuple[str, str, str, str]:
    """``(dtype, C type, identity, combine)`` of the accumulator of ``node``: 16-bit floats sum in
    float32; ``combine`` formats ``{a}`` (the accumulator) and ``{b}`` (a term) into the update."""
    dtype = dt.concrete(node.dtype)
    dtype = "float32" if dtype in ("float16", "bfloat16") else dtype
    floating = dt.is_float(dtype)
    identity = _IDENTITY[node.kind] if floating or node.kind not in _INT_IDENTITY else _INT_IDENTITY[node.kind]
    if node.kind in _COMBINE:
        combine = _COMBINE[node.kind]
    else:
        combine = ("NF_F" if floating else "NF_I") + ("MAX" if node.kind == "ReduceMax" else "MIN") + "({a}, {b})"
    return dtype, c_type(dtype, CUDA_TYPES), identity, combine


def _reduced(node: Reduce, accumulator: str) -> str:
    """C for the value of reduction ``node`` held in ``accumulator`` (``_accumulator``'s type):
    converted to the node's own dtype where that is narrower, as the interpreter has it (a
    float16 op's sum is a float16 value; a float one beside it would make ``*`` ambiguous)."""
    own = c_type(dt.concrete(node.dtype), CUDA_TYPES)
    return accumulator if own == _accumulator(node)[1] else f"(({own})({accumulator}))"


def _no_reads(tensor: str, indices) -> str:
    raise CompileError(f"a thread formula reads '{tensor}'")


#: a formula of thread coordinates (all non-negative) as C ``int`` arithmetic
small = IndexPrinter(lambda name: name, _no_reads, plain_division=True)


#: index arithmetic runs in 32-bit integers where every offset fits
INT32_LIMIT = 1 << 31


def narrow(op: Op) -> bool:
    """Whether ``op``'s index arithmetic fits 32-bit integers: every tensor it touches and every
    loop of it below 2^31 elements, no 64-bit integer in its formula or output."""
    sizes = [op.output.size, *(t.size for t in op.inputs), *op.extent.values()]
    wide = any(
        not isinstance(node, Index) and dt.concrete(node.dtype) in ("int64", "uint64", "weak_int")
        for node in op.body.walk()
        if not isinstance(node, Const)
    )
    return max(sizes, default=0) < INT32_LIMIT and not wide and dt.concrete(op.dtype) not in ("int64", "uint64")


def narrow_indices(op: Op, body: str) -> str:
    """``body`` (a kernel's statements) with its 64-bit index arithmetic made 32-bit where ``op``
    allows (``narrow``: half the registers, and integer division by a constant in a few
    instructions instead of a call)."""
    return body.replace("int64_t", "int") if narrow(op) else body


def _parameters(op: Op, tables: tuple[str, ...] = ()) -> str:
    """The output, the op's inputs in order, then the index tables named ``tables``."""
    params = [f"{c_type(op.dtype, CUDA_TYPES)} *__restrict__ nf_out"]
    params += [f"const {c_type(t.dtype, CUDA_TYPES)} *__restrict__ nf_in{k}" for k, t in enumerate(op.inputs)]
    params += [f"const int *__restrict__ {name}" for name in tables]
    return ", ".join(params)


def table_names(kernel: MmaKernel) -> tuple[str, ...]:
    """The C names of ``kernel.tables``, in order."""
    gathered = [side for side in ("a", "b") if kernel.gather(side) is not None]
    return tuple(name for side in gathered for name in (f"nf_tab_{side}_rows", f"nf_tab_{side}_depth"))


def lanes_name(position: int) -> str:
    """The name the elements of a vector load of the ``position``-th gathered tensor have in an
    operand expression (``nf_lanes<position>[v_vec]`` in C)."""
    return f"nf_lanes{position}__"


def _printer(op: Op, reduction, gather: Gather | None = None, lanes: tuple[Tensor, ...] = ()) -> ValuePrinter:
    names = {t.name: f"nf_in{k}" for k, t in enumerate(op.inputs)}
    tensors: dict[str, Tensor] = {t.name: t for t in op.inputs}
    for position, tensor in enumerate(lanes):
        names[tensor.name], tensors[tensor.name] = f"nf_lanes{position}", tensor
    for name in gather.tensors if gather is not None else ():  # read flat at the offset the tables give
        flat = Gather.flat(name)
        names[flat] = names[name]
        tensors[flat] = Tensor(flat, (tensors[name].size,), tensors[name].dtype)
    printer: ValuePrinter

    def read(tensor: str, indices) -> str:
        return printer.read(tensor, list(indices))

    index = IndexPrinter(lambda v: f"v_{v}", read)
    printer = ValuePrinter(tensors, names, index, reduction, op.extent, CUDA_TYPES)
    return printer


class _ReductionPrinter:
    """Prints values with their reductions as loops inside immediately called lambdas (computed
    only where a ``Select`` takes them).  A reduction that ``declare`` has named, or that a
    reduction around it has computed before its loops (one not using the axes it loops over), is
    read from its variable, not computed again: a softmax's max recomputed inside its sum of
    exponentials is computed once a point, not once a term, and once for both of the places a
    recomputed loss reads it."""

    def __init__(self, op: Op) -> None:
        self.op = op
        self.counter = 0
        self.scopes: list[dict[Expr, str]] = [{}]  # canonical reduction -> its C variable, innermost last
        self.values = _printer(op, self._reduction)
        self.index = self.values.index  # index expressions as C

    def __call__(self, node: Expr, target: str | None = None) -> str:
        return self.values(node, target)

    def declare(self, node: Expr, bound: frozenset[str] = frozenset()) -> str:
        """C declaring, in the current scope, the reductions of ``node`` computed once before it
        (``invariant_reductions`` of ``bound``) that are not declared yet; later prints read them."""
        lines = []
        for reduction in invariant_reductions(node, bound):
            key = canonical_reduction(reduction)
            if self._declared(key) is None:
                text = self._reduction(reduction)
                self.counter += 1
                self.scopes[-1][key] = name = f"nf_h{self.counter}"
                lines.append(f"const auto {name} = {text};")
        return " ".join(lines)

    @contextmanager
    def scope(self) -> Iterator[None]:
        """Declarations made inside are forgotten after it (the C block they are in ends)."""
        self.scopes.append({})
        try:
            yield
        finally:
            self.scopes.pop()

    def _declared(self, key: Expr) -> str | None:
        return next((scope[key] for scope in reversed(self.scopes) if key in scope), None)

    def _reduction(self, node: Reduce) -> str:
        declared = self._declared(canonical_reduction(node))
        if declared is not None:
            return declared
        self.counter += 1
        acc = f"nf_acc{self.counter}"
        dtype, ctype, identity, combine = _accumulator(node)
        with self.scope():
            before = self.declare(node.body, frozenset(node.axes)) if node.where is None else ""
            update = combine.format(a=acc, b=f"({self.values(node.body, dtype)})")
        loops = ""
        for axis, stride in loop_order(node, self.op.extent):
            if stride is None:
                loops += f"for (int64_t v_{axis} = 0; v_{axis} < {self.op.extent[axis]}; ++v_{axis}) "
            else:  # only the residue class the divisibility condition allows
                start = self.index(sympy.expand(-stride.sign * stride.rest))
                loops += (
                    f"for (int64_t v_{axis} = nf_mod({start}, {stride.modulus}); v_{axis} < {self.op.extent[axis]}; "
                    f"v_{axis} += {stride.modulus}) "
                )
        guard = f"if ({self.values(node.where, 'bool')}) " if node.where is not None else ""
        start = f"{before} {ctype} {acc} = {identity};".lstrip()
        total = f"([&]() {{ {start} {loops}{{ {guard}{acc} = {update}; }} return {acc}; }}())"
        return _reduced(node, total)


def invariant_reductions(node: Expr, bound: frozenset[str]) -> list[Reduce]:
    """The reductions inside ``node`` worth computing once before it, inner ones first: those
    evaluated wherever ``node`` is (not inside a ``Select``'s branches, the right side of ``&&`` or
    ``||``, or a guarded reduction's body, where a read may be valid only as guarded) that use none
    of the variables ``bound``, nor any a reduction between ``node`` and them loops over."""
    found: list[Reduce] = []

    def visit(item: Expr, binding: frozenset[str]) -> None:
        if isinstance(item, Select):
            visit(item.cond, binding)
        elif isinstance(item, Binary) and item.op in LOGICAL:
            visit(item.a, binding)
        elif isinstance(item, Reduce):
            if item.where is None:
                visit(item.body, binding | set(item.axes))
            if not (index_variables(item) - bound_variables(item)) & binding:
                found.append(item)
        else:
            for child in item.children():
                visit(child, binding)

    visit(node, bound)
    return found


@lru_cache(maxsize=4096)
def canonical_reduction(node: Reduce) -> Reduce:
    """``node`` with the axes it binds named by position (two copies of one reduction, recomputed
    in two places of a fused kernel, come out equal)."""
    axes = [axis for reduction in reductions(node) for axis in reduction.axes]
    return rename_in_expression(node, {axis: f"_h{k}" for k, axis in enumerate(dict.fromkeys(axes))})


def block_reduce_source(kernel: SimtKernel) -> str:
    """The CUDA C++ of a ``SimtKernel`` with ``block_reduce``: a block per output point."""
    op = kernel.op
    reduce, epilogue = reduction_parts(op)
    dtype, ctype, identity, combine = _accumulator(reduce)
    printer = _ReductionPrinter(op)
    # reductions of the term: those not using the reduced axes once a point, the rest once a term
    once = printer.declare(reduce.body, frozenset(reduce.axes)) if reduce.where is None else ""
    with printer.scope():
        each = printer.declare(reduce.body) if reduce.where is None else ""
        term = printer(reduce.body, dtype)
    guard = f"if ({printer(reduce.where, 'bool')}) " if reduce.where is not None else ""
    finish = _printer(op, lambda node: _reduced(node, "nf_total"))
    value = finish(epilogue if epilogue is not None else reduce, op.dtype)
    axes = [(a, op.extent[a]) for a in reduce.axes]
    terms = math.prod(e for _, e in axes)
    decode = unflatten_index("nf_flat", [(v, op.extent[v]) for v in op.indices]) if op.indices else ""
    threads = kernel.threads
    signature = f'extern "C" __global__ void __launch_bounds__({threads}) {kernel.name}({_parameters(op)}) {{\n'
    return signature + narrow_indices(
        op,
        f"    __shared__ {ctype} nf_partial[{threads // 32}];\n"
        f"    for (int64_t nf_flat = blockIdx.x; nf_flat < {kernel.points}; nf_flat += gridDim.x) {{\n"
        f"        {decode}\n"
        f"{_line(once, 8)}"
        f"        {ctype} nf_acc = {identity};\n"
        f"        for (int64_t nf_term = threadIdx.x; nf_term < {terms}; nf_term += {threads}) {{\n"
        f"            {_decode('nf_tt', 'nf_term', axes)}\n"
        f"{_line(each, 12)}"
        f"            {guard}nf_acc = {combine.format(a='nf_acc', b=f'({term})')};\n"
        f"        }}\n"
        f"        #pragma unroll\n"
        f"        for (int nf_shift = 16; nf_shift > 0; nf_shift >>= 1)\n"
        f"            nf_acc = {combine.format(a='nf_acc', b='__shfl_down_sync(0xffffffffu, nf_acc, nf_shift)')};\n"
        f"        if ((threadIdx.x & 31) == 0) nf_partial[threadIdx.x >> 5] = nf_acc;\n"
        f"        __syncthreads();\n"
        f"        if (threadIdx.x == 0) {{\n"
        f"            {ctype} nf_total = nf_partial[0];\n"
        f"            for (int w = 1; w < {threads // 32}; ++w)\n"
        f"                nf_total = {combine.format(a='nf_total', b='nf_partial[w]')};\n"
        f"            nf_out[nf_flat] = {value};\n"
        f"        }}\n"
        f"        __syncthreads();\n"
        "    }\n"
        "}\n",
    )


def simt_source(kernel: SimtKernel) -> str:
    """The CUDA C++ of a ``SimtKernel``: a grid-stride loop, one point a thread (or, with
    ``block_reduce``, one point a block)."""
    if kernel.block_reduce:
        return block_reduce_source(kernel)
    op = kernel.op
    printer = _ReductionPrinter(op)
    declarations = printer.declare(op.body)  # each reduction once a point
    value = printer(op.body, op.dtype)
    variables = [(v, op.extent[v]) for v in op.indices]
    decode = unflatten_index("nf_flat", variables) if variables else ""
    if op.scatter is None:
        store = f"nf_out[nf_flat] = {value};"
    else:
        if dt.concrete(op.dtype) not in ("float32", "float64", "int32", "int64"):
            raise CompileError(f"a scatter into {op.dtype} has no atomic add on the cuda target", op=op.name)
        targets = [printer.index(e) for e in op.scatter]
        offset = targets[0]
        for size, target in zip(op.shape[1:], targets[1:], strict=True):
            offset = f"({offset}) * {size} + {target}"
        atomic_type = "unsigned long long" if dt.concrete(op.dtype) == "int64" else None
        if atomic_type:
            store = f"atomicAdd(({atomic_type} *)&nf_out[{offset}], ({atomic_type})({value}));"
        else:
            store = f"atomicAdd(&nf_out[{offset}], {value});"
    signature = f'extern "C" __global__ void __launch_bounds__({kernel.threads}) {kernel.name}({_parameters(op)}) {{\n'
    return signature + narrow_indices(
        op,
        f"    for (int64_t nf_flat = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; nf_flat < {kernel.points}; "
        f"nf_flat += (int64_t)gridDim.x * blockDim.x) {{\n"
        f"        {decode}\n"
        f"{_line(declarations, 8)}"
        f"        {store}\n"
        "    }\n"
        "}\n",
    )


def _line(statements: str, indent: int) -> str:
    """``statements`` as a line of C indented by ``indent`` spaces (nothing where there are none)."""
    return f"{' ' * indent}{statements}\n" if statements else ""


def _decode(prefix: str, flat: str, variables) -> str:
    """C declaring ``v_<name>`` for ``variables`` (row-major) from ``flat``, its scratch named by ``prefix``."""
    return unflatten_index(flat, list(variables)).replace("rest_", f"{prefix}_rest")


def _pointer(op: Op, tensor: str) -> str:
    """The C name of input ``tensor`` of ``op``."""
    return f"nf_in{[t.name for t in op.inputs].index(tensor)}"


def _table_lookup(kernel: MmaKernel, side: str, gather: Gather, printer: ValuePrinter) -> str:
    """C declaring the gathered element's offset and guard variables from the index tables."""
    row_width, depth_width = 1 + len(gather.row_vars), 1 + len(gather.depth_vars)
    stride = kernel.depth_stride(side)
    depth = f"nf_k * {stride}" if stride is not None else "__ldg(nf_dt)"
    lines = [f"const int *nf_rt = nf_tab_{side}_rows + nf_r * {row_width};"]
    if stride is None:
        lines.append(f"const int *nf_dt = nf_tab_{side}_depth + nf_k * {depth_width};")
    lines.append(f"const int64_t v_{OFFSET} = __ldg(nf_rt) + {depth} + {printer.index(gather.rest)};")
    lines += [f"const int64_t v_{v} = __ldg(nf_rt + {1 + i});" for i, v in enumerate(gather.row_vars)]
    lines += [f"const int64_t v_{v} = __ldg(nf_dt + {1 + i});" for i, v in enumerate(gather.depth_vars)]
    return "\n                ".join(lines)


def _operand_loader(kernel: MmaKernel, side: str, printer: ValuePrinter) -> str:
    """C loading thread ``tid``'s elements of operand ``side`` for depth tile ``k0`` into registers:
    through the index tables where the operand has a table gather (a vector of ``vector(side)``
    elements at a time where its plan says so), else decoding every variable."""
    view = kernel.view
    gather = kernel.gather(side)
    row, col, count = kernel.load_coords(side)
    row, col = row.subs(VEC, 0), col.subs(VEC, 0)
    width = kernel.vector(side)
    rows_axis = view.m if side == "a" else view.n
    origin = "nf_m0" if side == "a" else "nf_n0"
    limit = view.sizes[1] if side == "a" else view.sizes[2]
    convert = _STORAGE[kernel.storage][1]
    head = (
        f"        #pragma unroll\n"
        f"        for (int element = 0; element < {count}; ++element) {{\n"
        f"            const int nf_row = {small(row)}, nf_col = {small(col)};\n"
        f"            const int64_t nf_r = {origin} + nf_row, nf_k = nf_k0 + nf_col;\n"
    )
    if gather is not None and width > 1:
        gathered = [next(t for t in view.op.inputs if t.name == name) for name in gather.tensors]
        dtype = gathered[0].dtype
        printer, value = _lane_value(view.op, gather, width)
        raw = {16: "uint4", 8: "uint2", 4: "uint32_t"}[width * dt.numpy_dtype(dtype).itemsize]
        guard_open, guard_close = "", ""
        if gather.guard is not None:  # the vector is read only where its guard holds (zeros else)
            guard_open = f"({printer(gather.guard, 'bool')}) ? "
            guard_close = f" : {raw}{{}}"
        element_type = c_type(dtype, CUDA_TYPES)
        loads = "".join(
            f"                const {raw} nf_raw{k} = {guard_open}"
            f"__ldg(reinterpret_cast<const {raw} *>({_pointer(view.op, tensor.name)} + v_{OFFSET})){guard_close};\n"
            f"                const {element_type} *nf_lanes{k} = "
            f"reinterpret_cast<const {element_type} *>(&nf_raw{k});\n"
            for k, tensor in enumerate(gathered)
        )
        return head + (
            f"            if (nf_r < {limit} && nf_k < {view.sizes[3]}) {{\n"
            f"                {_table_lookup(kernel, side, gather, printer)}\n"
            f"{loads}"
            f"                #pragma unroll\n"
            f"                for (int v_vec = 0; v_vec < {width}; ++v_vec)\n"
            f"                    nf_reg_{side}[element * {width} + v_vec] = {convert.format(value)};\n"
            f"            }} else {{\n"
            f"                #pragma unroll\n"
            f"                for (int v_vec = 0; v_vec < {width}; ++v_vec)\n"
            f"                    nf_reg_{side}[element * {width} + v_vec] = {convert.format('0.0f')};\n"
            f"            }}\n"
            f"        }}\n"
        )
    if gather is not None:
        printer = _printer(view.op, lambda node: _refuse(view.op), gather)
        value = printer(gather.expr, "float32")
        lookup = _table_lookup(kernel, side, gather, printer)
    else:
        value = printer(view.a if side == "a" else view.b, "float32")
        lookup = f"{_decode('nf_rr', 'nf_r', rows_axis)}\n                {_decode('nf_kk', 'nf_k', view.k)}"
    return head + (
        f"            float nf_value = 0.0f;\n"
        f"            if (nf_r < {limit} && nf_k < {view.sizes[3]}) {{\n"
        f"                {lookup}\n"
        f"                nf_value = {value};\n"
        f"            }}\n"
        f"            nf_reg_{side}[element] = {convert.format('nf_value')};\n"
        f"        }}\n"
    )


#: a thread hoists its copies' row-table entries out of the main loop when it has at most this many
#: copies of an operand a tile (more would go to local memory)
HOISTED_COPIES = 8


def _depth_ok(kernel: MmaKernel, depth: str) -> str:
    """C testing that ``depth`` lies inside the view's depth: ``true`` where the depth is whole tiles."""
    size = kernel.view.sizes[3]
    return "true" if size % kernel.tiles.block_k == 0 else f"{depth} < {size}"


def _within_depth(kernel: MmaKernel, depth: str) -> str:
    """C for ``depth``, or 0 past the view's depth (a table row that exists)."""
    inside = _depth_ok(kernel, depth)
    return depth if inside == "true" else f"({inside} ? {depth} : 0)"


def _hoisted(kernel: MmaKernel, side: str) -> bool:
    """Whether thread ``tid``'s copies of operand ``side`` read their row-table entries once, before
    the main loop (a ``wgmma`` kernel's producers hold no accumulators: twice as many)."""
    return kernel.load_coords(side)[2] <= HOISTED_COPIES * (2 if kernel.wgmma else 1)


def _depth_lines(kernel: MmaKernel, side: str) -> int:
    """How many depth-table entries a thread's copies of operand ``side`` read in a tile: one
    where they all share their depth column, else one a copy."""
    _, col, count = kernel.load_coords(side)
    return count if col.has(ELEMENT) else 1


def _hoisted_entries(kernel: MmaKernel, side: str) -> str:
    """C, before the main loop, for thread ``tid``'s copies of operand ``side``: their row-table
    entries, read once (the rows a thread copies are the same in every depth tile): the offset
    part ``nf_<side>_roff[e]`` (0 past the last row, ``nf_<side>_rok[e]`` false) and the row
    variables its guard uses; and ``nf_<side>_depth_entries(kt)``, reading the depth-table
    entries of tile ``kt`` into ``nf_<side>_dnext`` (one tile ahead of the copies, so their
    latency hides behind a tile of multiplies), called here for the first tile."""
    view, gather = kernel.view, kernel.gather(side)
    row, col, count = kernel.load_coords(side)
    origin = "nf_m0" if side == "a" else "nf_n0"
    limit = view.sizes[1] if side == "a" else view.sizes[2]
    width = 1 + len(gather.row_vars)
    names = [f"nf_{side}_roff", *(f"nf_{side}_rv{i}" for i in range(len(gather.row_vars)))]
    declare = "".join(f"    int {name}[{count}];\n" for name in names)
    reads = "".join(f"        {name}[element] = __ldg(nf_rt + {i});\n" for i, name in enumerate(names))
    depth_width = 1 + len(gather.depth_vars)
    lines = _depth_lines(kernel, side)
    depth_entries = (
        f"    int nf_{side}_dnext[{lines}][{depth_width}];\n"
        f"    auto nf_{side}_depth_entries = [&](int kt) {{\n"
        f"        #pragma unroll\n"
        f"        for (int element = 0; element < {lines}; ++element) {{\n"
        f"            const int vec = 0;\n"
        f"            const int64_t nf_k = (int64_t)kt * {kernel.tiles.block_k} + {small(col.subs(VEC, 0))};\n"
        f"            const int *nf_dt = nf_tab_{side}_depth + {_within_depth(kernel, 'nf_k')} * {depth_width};\n"
        f"            #pragma unroll\n"
        f"            for (int i = 0; i < {depth_width}; ++i) nf_{side}_dnext[element][i] = __ldg(nf_dt + i);\n"
        f"        }}\n"
        f"    }};\n"
        f"    nf_{side}_depth_entries(nf_first);\n"
    )
    if kernel.depth_stride(side) is not None:
        depth_entries = ""  # computed by each copy
    return (
        f"{declare}    bool nf_{side}_rok[{count}];\n"
        f"    #pragma unroll\n"
        f"    for (int element = 0; element < {count}; ++element) {{\n"
        f"        const int vec = 0;\n"
        f"        const int64_t nf_r = {origin} + {small(row.subs(VEC, 0))};\n"
        f"        nf_{side}_rok[element] = nf_r < {limit};\n"
        f"        const int *nf_rt = nf_tab_{side}_rows + (nf_{side}_rok[element] ? nf_r : 0) * {width};\n"
        f"{reads}"
        f"    }}\n"
        f"{depth_entries}"
    )


def _operand_copy(kernel: MmaKernel, side: str) -> str:
    """C issuing the ``cp.async`` copies of thread ``tid``'s vectors of operand ``side`` for depth
    tile ``kt`` (from ``nf_k0``) into stage ``stage`` (vectors past the tensor's rows or depth,
    or whose guard fails, are zero-filled and read nothing).  With its table entries hoisted
    (``_hoisted_entries``) a copy takes its row entry from registers and its depth entry from
    those read the tile before, and reads the next tile's (tiles are issued in order)."""
    view = kernel.view
    gather = kernel.gather(side)
    row, col, count = kernel.load_coords(side)
    row, col = row.subs(VEC, 0), col.subs(VEC, 0)
    printer = _printer(view.op, lambda node: _refuse(view.op), gather)
    guard = "true" if gather.guard is None else printer(gather.guard, "bool")
    copy_function = "nf_copy_cg" if kernel.wgmma else f"nf_copy<{kernel.copy_bytes(side)}>"
    # an offset read only where copied, so not negative: unsigned, it joins the pointer without a sign extension
    unsigned = "(uint32_t)" if narrow(view.op) else "(uint64_t)"
    copy = ""
    for position, tensor in enumerate(gather.tensors[: kernel.copies(side)]):  # a combined operand's each
        tile = f" + {position * kernel.tile_elements(side)}" if position else ""
        target = f"&nf_s{side}[stage * {kernel.stage_elements(side)}{tile} + {_at(kernel, side, ROW, COL)}]"
        pointer = _pointer(view.op, tensor)
        copy += (
            f"            {copy_function}({target}, {pointer} + (nf_copied ? {unsigned}v_{OFFSET} : 0u), nf_copied);\n"
        )
    if not _hoisted(kernel, side):
        origin = "nf_m0" if side == "a" else "nf_n0"
        limit = view.sizes[1] if side == "a" else view.sizes[2]
        unroll = "" if count <= 8 else " 4"  # many scalar copies: a few in flight keep registers free
        return (
            f"        #pragma unroll{unroll}\n"
            f"        for (int element = 0; element < {count}; ++element) {{\n"
            f"            const int vec = 0;\n"
            f"            const int nf_row = {small(row)}, nf_col = {small(col)};\n"
            f"            int64_t nf_r = {origin} + nf_row, nf_k = nf_k0 + nf_col;\n"
            f"            const bool nf_valid = nf_r < {limit} && {_depth_ok(kernel, 'nf_k')};\n"
            f"            if (!nf_valid) nf_r = nf_k = 0;\n"
            f"            {_table_lookup(kernel, side, gather, printer)}\n"
            f"            const bool nf_copied = nf_valid && {guard};\n"
            f"{copy}"
            f"        }}\n"
        )
    lines, depth_width = _depth_lines(kernel, side), 1 + len(gather.depth_vars)
    line = "element" if lines > 1 else "0"
    row_vars = "".join(
        f"                const int64_t v_{v} = nf_{side}_rv{i}[element];\n" for i, v in enumerate(gather.row_vars)
    )
    depth_vars = "".join(
        f"                const int64_t v_{v} = nf_dcur[{line}][{1 + i}];\n" for i, v in enumerate(gather.depth_vars)
    )
    stride = kernel.depth_stride(side)
    current = (
        f"            int nf_dcur[{lines}][{depth_width}];\n"
        f"            #pragma unroll\n"
        f"            for (int e = 0; e < {lines}; ++e)\n"
        f"                #pragma unroll\n"
        f"                for (int i = 0; i < {depth_width}; ++i) nf_dcur[e][i] = nf_{side}_dnext[e][i];\n"
        f"            if (kt + 1 < nf_last) nf_{side}_depth_entries(kt + 1);\n"
    )
    depth = f"nf_dcur[{line}][0]"
    if stride is not None:  # no table: the depth offset from the depth itself
        current, depth = "", f"(int64_t)(nf_k0 + nf_col) * {stride}"
    return (
        "        {\n"
        f"{current}"
        f"            #pragma unroll\n"
        f"            for (int element = 0; element < {count}; ++element) {{\n"
        f"                const int vec = 0;\n"
        f"                const int nf_row = {small(row)}, nf_col = {small(col)};\n"
        f"                const bool nf_k_ok = {_depth_ok(kernel, 'nf_k0 + nf_col')};\n"
        f"{row_vars}{depth_vars}"
        f"                const int64_t v_{OFFSET} = (int64_t)nf_{side}_roff[element] + {depth} + "
        f"{printer.index(gather.rest)};\n"
        f"                const bool nf_copied = nf_{side}_rok[element] && nf_k_ok && {guard};\n"
        f"{_indented(copy, 4)}"
        "            }\n"
        "        }\n"
    )


def _indented(lines: str, spaces: int) -> str:
    """``lines`` (each ending in a newline) with ``spaces`` more spaces before each."""
    return "".join(" " * spaces + line for line in lines.splitlines(keepends=True))


#: the C variables of the fragment and tile loops that shared-memory places are printed in
FM, FP, FN, KK, ROW, COL, WARP_M, WARP_N, WARP_K, WARPGROUP, STEP = sympy.symbols(
    "fm fp fn kk nf_row nf_col nf_warp_m nf_warp_n nf_warp_k nf_warpgroup nf_step", integer=True, nonnegative=True
)


def _warp_coordinates(tiles) -> str:
    """C giving a warp its place in the block: its row and column of warp tiles and, where the block's
    warps split each depth tile (``Tiles.warps_k``), its slice of the depth."""
    across = tiles.warps_m * tiles.warps_n
    if tiles.warps_k == 1:
        return f"    const int nf_warp_m = nf_warp / {tiles.warps_n}, nf_warp_n = nf_warp % {tiles.warps_n};\n"
    return (
        f"    const int nf_warp_m = (nf_warp % {across}) / {tiles.warps_n}, nf_warp_n = nf_warp % {tiles.warps_n};\n"
        f"    const int nf_warp_k = nf_warp / {across};\n"
    )


def _at(kernel: MmaKernel, side: str, row: sympy.Expr, col: sympy.Expr) -> str:
    """C for the place of tile element (``row``, ``col``) of operand ``side`` in a stage: the plan's
    ``smem_index`` (swizzled, in a ``wgmma`` kernel: ``MmaKernel.place``), the formula the
    tensor-core model executes."""
    logical = small(kernel.smem_index(side, row, col))
    return f"nf_swz128({logical})" if kernel.wgmma else logical


#: per storage dtype: the type two 16-bit elements pack into, and the packing function
_PAIRS = {
    "float16": ("__half2", "__halves2half2"),
    "bfloat16": ("__nv_bfloat162", "__halves2bfloat162"),
    "float32": ("float2", "make_float2"),
}


def _operand_store(kernel: MmaKernel, side: str) -> str:
    """C storing the registers of operand ``side`` into shared-memory stage ``stage``; a vector's
    elements lie together there (the layout follows the load direction), stored in pairs of
    16-bit elements or as one float2 or float4."""
    row, col, count = kernel.load_coords(side)
    width = kernel.vector(side)
    base = f"nf_s{side}[stage * {kernel.stage_elements(side)} + {_at(kernel, side, row, col)}"
    head = f"        #pragma unroll\n        for (int element = 0; element < {count}; ++element) {{\n"
    if width == 1:
        return head + f"            const int vec = 0;\n            {base}] = nf_reg_{side}[element];\n        }}\n"
    first = f"nf_reg_{side}[element * {width}"
    if kernel.storage == "tf32":  # float2 or float4 stores (a vector of 8 float16 elements: two float4)
        chunk = min(width, 4)
        lanes = ", ".join(f"{first} + vec + {v}]" for v in range(chunk))
        return head + (
            f"            #pragma unroll\n"
            f"            for (int vec = 0; vec < {width}; vec += {chunk})\n"
            f"                *reinterpret_cast<float{chunk} *>(&{base}]) = make_float{chunk}({lanes});\n"
            f"        }}\n"
        )
    pair, pack = _PAIRS[kernel.storage]
    return head + (
        f"            #pragma unroll\n"
        f"            for (int vec = 0; vec < {width}; vec += 2)\n"
        f"                *reinterpret_cast<{pair} *>(&{base}]) = {pack}({first} + vec], {first} + vec + 1]);\n"
        f"        }}\n"
    )


#: per 16-bit storage dtype: the functions taking a pair's (``_PAIRS``) first and second element, and the
#: one packing two floats into a pair (rounded to nearest even)
_HALVES = {
    "float16": ("__low2half", "__high2half", "__floats2half2_rn"),
    "bfloat16": ("__low2bfloat16", "__high2bfloat16", "__floats2bfloat162_rn"),
}


def _lane_value(op: Op, gather: Gather, width: int) -> tuple[ValuePrinter, str]:
    """A printer of ``op`` whose reads of ``gather``'s tensors are element ``v_vec`` of the arrays
    ``nf_lanes<k>`` (``width`` elements of the ``k``-th tensor, its dtype), and the gathered operand
    printed over them, as float."""
    dtype = next(t.dtype for t in op.inputs if t.name == gather.tensor)
    lanes = tuple(Tensor(lanes_name(k), (width,), dtype) for k in range(len(gather.tensors)))
    printer = _printer(op, lambda node: _refuse(op), gather, lanes)
    position = {Gather.flat(name): k for k, name in enumerate(gather.tensors)}

    def lane_read(node: Read) -> Read:
        return Read(lanes_name(position[node.tensor]), (index.var("vec"),), node.tensor_dtype)

    return printer, printer(map_reads(gather.expr, lane_read), "float32")


def _combiner(kernel: MmaKernel, side: str) -> str:
    """C declaring ``nf_combine_<side>``: a combined operand's expression (``MmaKernel.combined``)
    of one element of each of its tensors, as float."""
    view, gather = kernel.view, kernel.gather(side)
    element = c_type(next(t.dtype for t in view.op.inputs if t.name == gather.tensor), CUDA_TYPES)
    _, value = _lane_value(view.op, gather, 1)
    copies = len(gather.tensors)
    arguments = ", ".join(f"{element} nf_x{k}" for k in range(copies))
    arrays = " ".join(f"const {element} nf_lanes{k}[1] = {{nf_x{k}}};" for k in range(copies))
    return (
        f"    auto nf_combine_{side} = []({arguments}) -> float {{ const int v_vec = 0; {arrays} return {value}; }};\n"
    )


def _combined_registers(kernel: MmaKernel, side: str, target: str) -> str:
    """C loading the other tensors' fragment registers of combined operand ``side`` (from the tiles
    after the first, at the ``ldmatrix`` address ``nf_at``) and replacing each of the four registers
    ``target[reg]`` (the first tensor's) by the operand: a tf32 element rounded, a pair of 16-bit
    elements each computed in float and packed again."""
    copies, tile = kernel.copies(side), kernel.tile_elements(side)
    load = "nf_ldmatrix_x4" if kernel.layout(side) == "rows" else "nf_ldmatrix_x4_trans"
    base = "nf_wa" if side == "a" else "nf_wb"
    lines = [f"                uint32_t nf_other[{copies - 1}][4];"] if copies > 1 else []
    lines += [f"                {load}(nf_other[{k - 1}], {base} + {k * tile} + nf_at);" for k in range(1, copies)]
    lines.append("                #pragma unroll\n                for (int reg = 0; reg < 4; ++reg) {")
    if kernel.storage == "tf32":
        values = ", ".join(
            [f"__uint_as_float({target}[reg])"] + [f"__uint_as_float(nf_other[{k}][reg])" for k in range(copies - 1)]
        )
        lines.append(f"                    {target}[reg] = __float_as_uint(nf_tf32(nf_combine_{side}({values})));")
    else:
        pair = _PAIRS[kernel.storage][0]
        low, high, pack = _HALVES[kernel.storage]
        registers = [f"{target}[reg]"] + [f"nf_other[{k}][reg]" for k in range(copies - 1)]
        pairs = [f"*reinterpret_cast<const {pair} *>(&{register})" for register in registers]
        lows, highs = (", ".join(f"{half}({p})" for p in pairs) for half in (low, high))
        lines += [
            f"                    const {pair} nf_pair = {pack}(nf_combine_{side}({lows}), "
            f"nf_combine_{side}({highs}));",
            f"                    {target}[reg] = *reinterpret_cast<const uint32_t *>(&nf_pair);",
        ]
    lines.append("                }")
    return "\n".join(lines)


def _fragments(kernel: MmaKernel) -> str:
    """C loading a warp's A and B fragments for depth step ``kk`` of the current stage: by
    ``ldmatrix`` where the plan says so, else element by element; tf32 registers of a direct
    kernel (whose copies land unrounded) then rounded by ``nf_tf32`` (on the register path the
    operands were rounded on their way into shared memory).  Rounding once in shared memory, each
    thread its own copies once they landed, ran slower on an H100 (capsule stride 1 tf32 forward
    and backward 0.163 -> 0.181 ms): the reads back sit between the copies' wait and the barrier."""
    tiles = kernel.tiles
    tf32 = kernel.storage == "tf32" and kernel.direct
    unit = kernel.ldmatrix_unit
    lines: list[str] = []

    def rounded(registers: str) -> str:
        """A loop rounding the four tf32 registers ``registers[reg]`` (``nf_tf32``: to nearest even)."""
        register = f"{registers}[reg]"
        return (
            "                #pragma unroll\n                for (int reg = 0; reg < 4; ++reg) "
            f"{register} = __float_as_uint(nf_tf32(__uint_as_float({register})));"
        )

    def by_element(side: str, array: str, fragment: str, fragments: int, registers: int, at: str) -> list[str]:
        """Lines loading the tf32 fragments ``array[fragment][reg]`` of operand ``side`` one element a
        register (a combined operand's from each of its tiles)."""
        tile, size = ("nf_wa" if side == "a" else "nf_wb"), kernel.tile_elements(side)
        elements = [f"{tile}[{at}]"] + [f"{tile}[{k * size} + {at}]" for k in range(1, kernel.copies(side))]
        value = f"nf_combine_{side}({', '.join(elements)})" if kernel.combined(side) else elements[0]
        load = f"__float_as_uint(nf_tf32({value}))" if tf32 else f"__float_as_uint({value})"
        return [
            f"            #pragma unroll\n            for (int {fragment} = 0; {fragment} < {fragments}; ++{fragment})",
            f"                #pragma unroll\n                for (int reg = 0; reg < {registers}; ++reg)",
            f"                    {array}[{fragment}][reg] = {load};",
        ]

    def finished(side: str, registers: str) -> list[str]:
        """Lines finishing the ``ldmatrix``-loaded ``registers`` of operand ``side``: combined, or
        tf32 ones rounded."""
        if kernel.combined(side):
            return [_combined_registers(kernel, side, registers)]
        return [rounded(registers)] if tf32 else []

    if kernel.by_ldmatrix("a"):
        a_row, a_col = ldmatrix_a_address(kernel.layout("a"), unit)
        a_load = "nf_ldmatrix_x4" if kernel.layout("a") == "rows" else "nf_ldmatrix_x4_trans"
        a_at = _at(kernel, "a", FM * 16 + a_row, KK + a_col)
        lines += [
            f"            #pragma unroll\n            for (int fm = 0; fm < {tiles.frags_m}; ++fm) {{",
            f"                const int nf_at = {a_at};",
            f"                {a_load}(nf_af[fm], nf_wa + nf_at);",
            *finished("a", "nf_af[fm]"),
            "            }",
        ]
    else:
        a_row, a_col = tf32_a_coords()
        lines += by_element("a", "nf_af", "fm", tiles.frags_m, 4, _at(kernel, "a", FM * 16 + a_row, KK + a_col))
    if kernel.by_ldmatrix("b"):
        b_row, b_col = ldmatrix_b_address(kernel.layout("b"), unit)
        b_load = "nf_ldmatrix_x4" if kernel.layout("b") == "rows" else "nf_ldmatrix_x4_trans"
        b_at = _at(kernel, "b", FP * 16 + b_row, KK + b_col)
        lines += [
            f"            #pragma unroll\n            for (int fp = 0; fp < {tiles.frags_n // 2}; ++fp) {{",
            "                uint32_t nf_r4[4];",
            f"                const int nf_at = {b_at};",
            f"                {b_load}(nf_r4, nf_wb + nf_at);",
            *finished("b", "nf_r4"),
            "                nf_bf[2 * fp][0] = nf_r4[0]; nf_bf[2 * fp][1] = nf_r4[1];",
            "                nf_bf[2 * fp + 1][0] = nf_r4[2]; nf_bf[2 * fp + 1][1] = nf_r4[3];",
            "            }",
        ]
    else:
        b_row, b_col = tf32_b_coords()
        lines += by_element("b", "nf_bf", "fn", tiles.frags_n, 2, _at(kernel, "b", FN * 8 + b_row, KK + b_col))
    return "\n".join(lines) + "\n"


def _products(kernel: MmaKernel) -> str:
    """C multiplying the warp's fragments ``nf_af`` and ``nf_bf`` of one depth step into its accumulators."""
    tiles = kernel.tiles
    lines = [
        f"            #pragma unroll\n            for (int fm = 0; fm < {tiles.frags_m}; ++fm)",
        f"                #pragma unroll\n                for (int fn = 0; fn < {tiles.frags_n}; ++fn)",
        f'                    asm volatile("{_MMA[kernel.storage]} {{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, '
        '{%8, %9}, {%0, %1, %2, %3};"',
        '                        : "+f"(nf_acc[fm][fn][0]), "+f"(nf_acc[fm][fn][1]), "+f"(nf_acc[fm][fn][2]), '
        '"+f"(nf_acc[fm][fn][3])',
        '                        : "r"(nf_af[fm][0]), "r"(nf_af[fm][1]), "r"(nf_af[fm][2]), "r"(nf_af[fm][3]), '
        '"r"(nf_bf[fn][0]), "r"(nf_bf[fn][1]));',
    ]
    return "\n".join(lines) + "\n"


def _finished(kernel: MmaKernel) -> tuple[str, str]:
    """C for the output offset of the point whose variables are declared, and the epilogue's
    value there from the accumulated ``nf_acc_value``."""
    view = kernel.view
    printer = _printer(view.op, lambda node: _reduced(node, "nf_acc_value"))
    body: Expr = view.epilogue if view.epilogue is not None else view.reduce
    return printer.index(view.out_offset), printer(body, view.op.dtype)


def memory_order(view) -> list[tuple[str, int]]:
    """The variables of ``view``'s points (batch, rows, columns) in the order their output offset
    steps through memory, the largest stride first (a finishing kernel's neighbouring threads then
    touch neighbouring elements: capsule28's second weight gradient's columns, its output channels
    and pose columns, lay 576 floats apart every fourth), where the offset is affine in them with
    constant strides; else as the view lists them."""
    variables = [*view.batch, *view.m, *view.n]
    terms = index.linear_terms(sympy.expand(view.out_offset))
    if terms is None or not all(stride.is_Integer for stride in terms.values()):
        return variables
    return sorted(variables, key=lambda variable: -int(terms.get(variable[0], 0)))


def finish_source(kernel: MmaKernel) -> str:
    """The CUDA C++ finishing a split kernel: each point of its piece from the workspace's sum
    through the epilogue into the output, the workspace left zeroed for the next run (kernel
    ``<name>_finish``; the output, the op's inputs, then the workspace)."""
    view = kernel.view
    offset, value = _finished(kernel)
    parameters = _parameters(view.op) + ", float *__restrict__ nf_ws"
    decode = _decode("nf_pp", "nf_flat", memory_order(view))
    signature = f'extern "C" __global__ void __launch_bounds__(256) {kernel.name}_finish({parameters}) {{\n'
    return signature + narrow_indices(
        view.op,
        f"    for (int64_t nf_flat = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; nf_flat < {kernel.finish_points}; "
        f"nf_flat += (int64_t)gridDim.x * blockDim.x) {{\n" + f"        {decode}\n"
        f"        const float nf_acc_value = nf_ws[{offset}];\n"
        f"        nf_ws[{offset}] = 0.0f;\n"
        f"        nf_out[{offset}] = {value};\n"
        "    }\n"
        "}\n",
    )


#: the C variables of the epilogue's loops: which half of a fragment's rows (``REG // 2``) and which
#: of a lane's two neighbouring columns (``REG % 2``)
HALF, ODD = sympy.symbols("nf_h nf_o", integer=True, nonnegative=True)


def _epilogue(kernel: MmaKernel) -> str:
    """C taking each lane's accumulators through the epilogue to the output (or, for a split depth,
    adding the sums into the workspace), under the row and column guards.  A lane's columns are
    decoded once (their guard, the column part of the offset, ``MmaKernel.output_parts``, and the
    column variables the epilogue reads), then row by row its row variables and the row part,
    each element's offset the sum of the two (the whole offset where no such split exists).  With
    ``paired_stores`` registers ``2p`` and ``2p + 1`` (an even column and its neighbour, which the
    even width keeps inside the output) leave as one two-element vector (a split kernel's sums
    as one ``float2`` atomic addition)."""
    view, tiles = kernel.view, kernel.tiles
    _, m, n, _ = view.sizes
    parts = kernel.output_parts
    offset, value = _finished(kernel)
    printer = _printer(view.op, lambda node: _reduced(node, "nf_acc_value"))
    wanted = index_variables(with_reduce(view.epilogue, Const(0))) if view.epilogue is not None else set()
    wanted |= set() if parts else index.variables(view.out_offset)
    kept = [v for v, _ in view.n if v in wanted]
    row, col = accumulator_coords()
    row, col = small(row.subs(REG, 2 * HALF)), small(col.subs(REG, ODD))
    frags = tiles.frags_n
    columns = (
        f"    int64_t nf_coff[{frags}][2];\n    bool nf_cok[{frags}][2];\n"
        + "".join(f"    int64_t nf_cv_{v}[{frags}][2];\n" for v in kept)
        + f"    #pragma unroll\n    for (int fn = 0; fn < {frags}; ++fn)\n"
        f"    #pragma unroll\n    for (int nf_o = 0; nf_o < 2; ++nf_o) {{\n"
        f"        const int64_t nf_c = nf_n0 + nf_warp_n * {tiles.warp_n} + fn * 8 + {col};\n"
        f"        nf_cok[fn][nf_o] = nf_c < {n};\n"
        f"        {_decode('nf_cc', 'nf_c', view.n)}\n"
        f"        nf_coff[fn][nf_o] = {printer.index(parts.col) if parts else '0'};\n"
        + "".join(f"        nf_cv_{v}[fn][nf_o] = v_{v};\n" for v in kept)
        + "    }\n"
    )

    def column(odd: str) -> str:
        return "".join(f"const int64_t v_{v} = nf_cv_{v}[fn][{odd}]; " for v in kept)

    place = "nf_roff + nf_coff[fn][nf_o]" if parts else offset
    if kernel.paired_stores and kernel.splits > 1:  # both sums into the workspace at once (Hopper)
        store = (
            f"            if (nf_cok[fn][0]) {{\n"
            f"                const int reg = 2 * nf_h, nf_o = 0;\n"
            f"                {column('0')}\n"
            f"                float *nf_sum = &nf_ws[{place}];\n"
            f"#if __CUDA_ARCH__ >= 900\n"
            f"                atomicAdd(reinterpret_cast<float2 *>(nf_sum), "
            f"make_float2(nf_acc[fm][fn][reg], nf_acc[fm][fn][reg + 1]));\n"
            f"#else\n"
            f"                atomicAdd(nf_sum, nf_acc[fm][fn][reg]);\n"
            f"                atomicAdd(nf_sum + 1, nf_acc[fm][fn][reg + 1]);\n"
            f"#endif\n"
            f"            }}\n"
        )
    elif kernel.paired_stores:
        element = CUDA_TYPES[view.op.dtype]
        pair, pack = _PAIRS[view.op.dtype]
        store = (
            f"            if (nf_cok[fn][0]) {{\n"
            f"                const int reg = 2 * nf_h, nf_o = 0;\n"
            f"                {element} nf_second;\n"
            f"                {{\n"
            f"                    {column('1')}\n"
            f"                    const float nf_acc_value = nf_acc[fm][fn][reg + 1];\n"
            f"                    nf_second = {value};\n"
            f"                }}\n"
            f"                {column('0')}\n"
            f"                const float nf_acc_value = nf_acc[fm][fn][reg];\n"
            f"                *reinterpret_cast<{pair} *>(&nf_out[{place}]) = {pack}({value}, nf_second);\n"
            f"            }}\n"
        )
    else:
        written = f"atomicAdd(&nf_ws[{place}], nf_acc_value);" if kernel.splits > 1 else f"nf_out[{place}] = {value};"
        store = (
            f"            #pragma unroll\n"
            f"            for (int nf_o = 0; nf_o < 2; ++nf_o)\n"
            f"            if (nf_cok[fn][nf_o]) {{\n"
            f"                const int reg = 2 * nf_h + nf_o;\n"
            f"                {column('nf_o')}\n"
            f"                const float nf_acc_value = nf_acc[fm][fn][reg];\n"
            f"                {written}\n"
            f"            }}\n"
        )
    row_offset = f"{printer.index(parts.row)} + {printer.index(parts.rest)}" if parts else "0"
    return columns + (
        f"    #pragma unroll\n    for (int fm = 0; fm < {tiles.frags_m}; ++fm)\n"
        f"    #pragma unroll\n    for (int nf_h = 0; nf_h < 2; ++nf_h) {{\n"
        f"        const int64_t nf_r = nf_m0 + nf_warp_m * {tiles.warp_m} + fm * 16 + {row};\n"
        f"        if (nf_r < {m}) {{\n"
        f"            {_decode('nf_rr', 'nf_r', view.m)}\n"
        f"            const int64_t nf_roff = {row_offset};\n"
        f"            #pragma unroll\n"
        f"            for (int fn = 0; fn < {frags}; ++fn) {{\n"
        f"{store}"
        f"            }}\n"
        f"        }}\n"
        f"    }}\n"
    )


def mma_source(kernel: MmaKernel) -> str:
    """The CUDA C++ of an ``MmaKernel``."""
    view, tiles = kernel.view, kernel.tiles
    op = view.op
    printer = _printer(op, lambda node: _refuse(op))
    storage = _STORAGE[kernel.storage][0]
    depth = WARP_K * tiles.slice_k if tiles.warps_k > 1 else sympy.Integer(0)
    a_warp = _at(kernel, "a", WARP_M * tiles.warp_m, depth)
    b_warp = _at(kernel, "b", WARP_N * tiles.warp_n, depth)
    splits = kernel.splits
    batch = _decode("nf_bb", f"(int64_t)(blockIdx.z / {splits})", view.batch) if view.batch else ""
    first = f"(blockIdx.z % {splits}) * {kernel.split_tiles}"
    parameters = _parameters(op, table_names(kernel)) + (", float *__restrict__ nf_ws" if kernel.splits > 1 else "")
    bounds = f"{kernel.block_threads}, 1" if kernel.has_producer else f"{tiles.threads}"
    signature = f'extern "C" __global__ void __launch_bounds__({bounds}) {kernel.name}({parameters}) {{\n'
    if kernel.wgmma:
        main = _wgmma_loop(kernel)
    elif kernel.specialized:
        main = _specialized_loop(kernel, a_warp, b_warp)
    elif kernel.direct:
        main = _direct_loop(kernel, a_warp, b_warp)
    else:
        main = _register_loop(kernel, a_warp, b_warp, printer)
    return signature + narrow_indices(
        op,
        f"    extern __shared__ __align__({ATOM_BYTES}) unsigned char nf_smem[];\n"
        f"    {storage} *nf_sa = reinterpret_cast<{storage} *>(nf_smem);\n"
        f"    {storage} *nf_sb = nf_sa + {kernel.stages * kernel.stage_elements('a')};\n"
        f"    const int tid = threadIdx.x, lane = tid & 31, nf_warp = tid >> 5;\n"
        f"{_warp_coordinates(tiles)}"
        f"    const int64_t nf_m0 = (int64_t)blockIdx.y * {tiles.block_m};\n"
        f"    const int64_t nf_n0 = (int64_t)blockIdx.x * {tiles.block_n};\n"
        f"    {batch}\n"
        f"    float nf_acc[{tiles.frags_m}][{tiles.frags_n}][4];\n"
        f"    #pragma unroll\n    for (int fm = 0; fm < {tiles.frags_m}; ++fm)\n"
        f"    #pragma unroll\n    for (int fn = 0; fn < {tiles.frags_n}; ++fn)\n"
        f"    #pragma unroll\n    for (int reg = 0; reg < 4; ++reg) nf_acc[fm][fn][reg] = 0.0f;\n"
        f"    const int nf_first = {first};\n"
        f"    const int nf_last = min(nf_first + {kernel.split_tiles}, {kernel.depth_tiles});\n"
        + main
        + _slices_summed(kernel)
        + f"{_epilogue(kernel)}"
        "}\n",
    )


def _compute(kernel: MmaKernel, a_warp: str, b_warp: str) -> str:
    """C multiplying the warp's fragments of stage ``stage`` (its slice of the depth tile, where the
    block's warps split it: ``Tiles.warps_k``)."""
    storage = _STORAGE[kernel.storage][0]
    tiles = kernel.tiles
    return (
        f"        const {storage} *nf_wa = nf_sa + stage * {kernel.stage_elements('a')} + {a_warp};\n"
        f"        const {storage} *nf_wb = nf_sb + stage * {kernel.stage_elements('b')} + {b_warp};\n"
        f"        #pragma unroll\n"
        f"        for (int kk = 0; kk < {tiles.slice_k}; kk += {kernel.mma_shape[2]}) {{\n"
        f"            uint32_t nf_af[{tiles.frags_m}][4], nf_bf[{tiles.frags_n}][2];\n"
        f"{_fragments(kernel)}"
        f"{_products(kernel)}"
        f"        }}\n"
    )


def _slices_summed(kernel: MmaKernel) -> str:
    """C adding the accumulators of a block's depth slices (``Tiles.warps_k``) into those of slice 0,
    through shared memory once the main loop is done (slice by slice, in order; a register a thread at
    a time, so that a warp's lanes touch neighbouring words), then leaving the epilogue to slice 0."""
    tiles = kernel.tiles
    if tiles.warps_k == 1:
        return ""
    threads = tiles.threads // tiles.warps_k
    count = tiles.frags_m * tiles.frags_n * 4
    place = f"((nf_slice * {count}) + (fm * {tiles.frags_n} + fn) * 4 + reg) * {threads} + nf_slot"
    loops = (
        f"        #pragma unroll\n        for (int fm = 0; fm < {tiles.frags_m}; ++fm)\n"
        f"        #pragma unroll\n        for (int fn = 0; fn < {tiles.frags_n}; ++fn)\n"
        f"        #pragma unroll\n        for (int reg = 0; reg < 4; ++reg)\n"
    )
    return (
        "    nf_copy_wait<0>();\n"
        "    __syncthreads();\n"
        "    {\n"
        "        float *nf_sums = reinterpret_cast<float *>(nf_smem);\n"
        f"        const int nf_slot = tid % {threads};\n"
        "        if (nf_warp_k > 0) {\n"
        "            const int nf_slice = nf_warp_k - 1;\n"
        + _indented(loops, 4)
        + f"                nf_sums[{place}] = nf_acc[fm][fn][reg];\n"
        "        }\n"
        "        __syncthreads();\n"
        "        if (nf_warp_k > 0) return;\n"
        f"        for (int nf_slice = 0; nf_slice < {tiles.warps_k - 1}; ++nf_slice)\n"
        + loops
        + f"            nf_acc[fm][fn][reg] += nf_sums[{place}];\n"
        "    }\n"
    )


def _register_loop(kernel: MmaKernel, a_warp: str, b_warp: str, printer: ValuePrinter) -> str:
    """The main loop through registers: tile kt + 1 gathered (and converted) into registers while
    the warps multiply tile kt, then stored into the other of two stages."""
    storage = _STORAGE[kernel.storage][0]
    a_count = kernel.load_coords("a")[2] * kernel.vector("a")
    b_count = kernel.load_coords("b")[2] * kernel.vector("b")
    block_k = kernel.tiles.block_k
    return (
        f"    {storage} nf_reg_a[{a_count}], nf_reg_b[{b_count}];\n"
        f"    auto nf_load = [&](int64_t nf_k0) {{\n"
        f"{_operand_loader(kernel, 'a', printer)}"
        f"{_operand_loader(kernel, 'b', printer)}"
        f"    }};\n"
        f"    auto nf_store = [&](int stage) {{\n"
        f"{_operand_store(kernel, 'a')}"
        f"{_operand_store(kernel, 'b')}"
        f"    }};\n"
        f"    nf_load((int64_t)nf_first * {block_k});\n"
        f"    nf_store(0);\n"
        f"    __syncthreads();\n"
        f"    for (int kt = nf_first; kt < nf_last; ++kt) {{\n"
        f"        const int stage = (kt - nf_first) & 1;\n"
        f"        if (kt + 1 < nf_last) nf_load((int64_t)(kt + 1) * {block_k});\n"
        f"{_compute(kernel, a_warp, b_warp)}"
        f"        if (kt + 1 < nf_last) nf_store(stage ^ 1);\n"
        f"        __syncthreads();\n"
        f"    }}\n"
    )


def _direct_loop(kernel: MmaKernel, a_warp: str, b_warp: str) -> str:
    """The main loop through ``cp.async``: ``stages - 1`` tiles in flight while the warps multiply one."""
    stages, block_k = kernel.stages, kernel.tiles.block_k
    return (
        "".join(_combiner(kernel, side) for side in ("a", "b") if kernel.combined(side))
        + "".join(_hoisted_entries(kernel, side) for side in ("a", "b") if _hoisted(kernel, side))
        + f"    auto nf_issue = [&](int kt, int stage) {{\n"
        f"        const int64_t nf_k0 = (int64_t)kt * {block_k};\n"
        f"{_operand_copy(kernel, 'a')}"
        f"{_operand_copy(kernel, 'b')}"
        f"    }};\n"
        f"    #pragma unroll\n"
        f"    for (int s = 0; s < {stages - 1}; ++s) {{\n"
        f"        if (nf_first + s < nf_last) nf_issue(nf_first + s, s);\n"
        f"        nf_copy_commit();\n"
        f"    }}\n"
        f"    for (int kt = nf_first; kt < nf_last; ++kt) {{\n"
        f"        nf_copy_wait<{stages - 2}>();\n"
        f"        __syncthreads();\n"
        f"        const int nf_next = kt + {stages - 1};\n"
        f"        if (nf_next < nf_last) nf_issue(nf_next, (nf_next - nf_first) % {stages});\n"
        f"        nf_copy_commit();\n"
        f"        const int stage = (kt - nf_first) % {stages};\n"
        f"{_compute(kernel, a_warp, b_warp)}"
        f"    }}\n"
    )


def _wgmma(kernel: MmaKernel) -> str:
    """C of one warpgroup's ``wgmma`` on descriptors ``nf_da`` and ``nf_db``, into ``nf_acc``
    (register ``4 fn + reg`` of the instruction is ``nf_acc[0][fn][reg]``: the layout of
    ``block_n / 8`` m16n8 accumulator fragments, ``accumulator_coords``)."""
    n = kernel.tiles.block_n
    kind = {"float16": "f16", "bfloat16": "bf16"}[kernel.storage]
    count = n // 2
    trans = ", ".join(str(int(kernel.layout(side) == "depth")) for side in ("a", "b"))
    registers = ", ".join(f"%{i}" for i in range(count))
    outputs = ", ".join(f'"+f"(nf_acc[0][{i // 4}][{i % 4}])' for i in range(count))
    return (
        f'            asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, 1, 0;\\n"\n'
        f'                "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind} "\n'
        f'                "{{{registers}}}, %{count}, %{count + 1}, p, 1, 1, {trans};\\n}}"\n'
        f"                : {outputs}\n"
        f'                : "l"(nf_da), "l"(nf_db));\n'
    )


#: groups of multiplies a warpgroup leaves in flight when it waits (and releases the stage of the one before)
WGMMA_GROUPS_IN_FLIGHT = 1


def _producer(kernel: MmaKernel) -> str:
    """C of a kernel whose producer warpgroup (the warps after the tiles' own) copies the operand
    tiles by ``cp.async`` into ``stages`` stages (``has_producer``): the mbarriers after the tiles,
    each stage's ``full`` one signalled as its copies land and its ``empty`` one
    by each multiplying warp once done with it; the producer refills a stage once it is empty,
    then leaves (the multiplying warps' loop follows)."""
    stages, block_k = kernel.stages, kernel.tiles.block_k
    consumers = kernel.tiles.threads
    tile_bytes = stages * (kernel.stage_elements("a") + kernel.stage_elements("b")) * kernel.element_bytes
    return (
        f"    unsigned long long *nf_bars = reinterpret_cast<unsigned long long *>(nf_smem + {tile_bytes});\n"
        f"    if (tid == 0) {{\n"
        f"        for (int s = 0; s < {stages}; ++s) {{\n"
        f"            nf_bar_init(nf_bars + s, {kernel.copy_threads});\n"
        f"            nf_bar_init(nf_bars + {stages} + s, {consumers // 32});\n"
        f"        }}\n"
        f"    }}\n"
        f"    __syncthreads();\n"
        f"    if (tid >= {consumers}) {{  /* the producer warpgroup */\n"
        f"        const int tid = threadIdx.x - {consumers};\n"
        + "".join(_hoisted_entries(kernel, side) for side in ("a", "b") if _hoisted(kernel, side))
        + f"    auto nf_issue = [&](int kt, int stage) {{\n"
        f"        const int64_t nf_k0 = (int64_t)kt * {block_k};\n"
        f"{_operand_copy(kernel, 'a')}"
        f"{_operand_copy(kernel, 'b')}"
        f"    }};\n"
        f"        for (int kt = nf_first; kt < nf_last; ++kt) {{\n"
        f"            const int nf_n = kt - nf_first, stage = nf_n % {stages};\n"
        f"            if (nf_n >= {stages}) nf_bar_wait(nf_bars + {stages} + stage, (nf_n / {stages} - 1) & 1);\n"
        f"            nf_issue(kt, stage);\n"
        f"            nf_bar_copies(nf_bars + stage);\n"
        f"        }}\n"
        f"        nf_copy_wait<0>();\n"
        f"        return;\n"
        f"    }}\n"
    )


def _specialized_loop(kernel: MmaKernel, a_warp: str, b_warp: str) -> str:
    """The main loop of a ``specialized`` ``mma.sync`` kernel: the producer warpgroup copies
    (``_producer``); each multiplying warp waits for a stage's copies, multiplies its fragments
    and says it is done with the stage."""
    stages = kernel.stages
    return (
        "".join(_combiner(kernel, side) for side in ("a", "b") if kernel.combined(side))
        + _producer(kernel)
        + f"    for (int kt = nf_first; kt < nf_last; ++kt) {{\n"
        f"        const int nf_n = kt - nf_first, stage = nf_n % {stages};\n"
        f"        nf_bar_wait(nf_bars + stage, (nf_n / {stages}) & 1);\n"
        f"{_compute(kernel, a_warp, b_warp)}"
        f"        __syncwarp();\n"
        f"        if (lane == 0) nf_bar_arrive(nf_bars + {stages} + stage);\n"
        f"    }}\n"
    )


def _wgmma_loop(kernel: MmaKernel) -> str:
    """The main loop of a ``wgmma`` kernel, warp-specialised: the producer warpgroup (the warps
    after the tiles' own) copies operand tiles by ``cp.async`` into ``stages`` swizzled stages,
    each stage's copies signalling its ``full`` mbarrier as they land, and refills a stage once
    its ``empty`` mbarrier says the multiplies that read it are done; each multiplying
    warpgroup waits for a stage, multiplies its 64 rows asynchronously, and releases the
    stage of the group before once that group is done (one group left in flight)."""
    stages = kernel.stages
    steps = kernel.tiles.block_k // WGMMA_K
    lag = WGMMA_GROUPS_IN_FLIGHT
    descriptors, stage_bytes = {}, {}
    for side in ("a", "b"):
        start, leading, stride = kernel.descriptor(side, WARPGROUP, STEP)
        descriptors[side] = f"nf_desc(nf_{side}_stage + {small(start)}, {leading}, {stride})"
        stage_bytes[side] = kernel.tile_elements(side) * kernel.element_bytes
    fence = "".join(
        f'    asm volatile("" : "+f"(nf_acc[0][{fn}][{reg}]) :: "memory");\n'
        for fn in range(kernel.tiles.frags_n)
        for reg in range(4)
    )
    return (
        _producer(kernel) + f"    const int nf_warpgroup = nf_warp >> 2;\n"
        f"    const uint32_t nf_sa_address = (uint32_t)__cvta_generic_to_shared(nf_sa);\n"
        f"    const uint32_t nf_sb_address = (uint32_t)__cvta_generic_to_shared(nf_sb);\n"
        f"    for (int kt = nf_first; kt < nf_last; ++kt) {{\n"
        f"        const int nf_n = kt - nf_first, stage = nf_n % {stages};\n"
        f"        nf_bar_wait(nf_bars + stage, (nf_n / {stages}) & 1);\n"
        f"        nf_proxy_fence();\n"
        f"        const uint32_t nf_a_stage = nf_sa_address + stage * {stage_bytes['a']};\n"
        f"        const uint32_t nf_b_stage = nf_sb_address + stage * {stage_bytes['b']};\n"
        f"        nf_wgmma_fence();\n"
        f"        #pragma unroll\n"
        f"        for (int nf_step = 0; nf_step < {steps}; ++nf_step) {{\n"
        f"            const unsigned long long nf_da = {descriptors['a']};\n"
        f"            const unsigned long long nf_db = {descriptors['b']};\n"
        f"{_wgmma(kernel)}"
        f"        }}\n"
        f"        nf_wgmma_commit();\n"
        f"        nf_wgmma_wait<{lag}>();\n"
        f"        if (nf_n >= {lag}) {{\n"
        f"            __syncwarp();\n"
        f"            if (lane == 0) nf_bar_arrive(nf_bars + {stages} + (nf_n - {lag}) % {stages});\n"
        f"        }}\n"
        f"    }}\n"
        f"    nf_wgmma_wait<0>();\n"
        f"{fence}"
    )


def _refuse(op: Op) -> str:
    raise CompileError("an operand of a tensor-core kernel holds a reduction", op=op.name)


def kernel_source(kernel: MmaKernel | SimtKernel) -> str:
    """The CUDA C++ of one kernel (and of its finishing kernel, where its depth is split)."""
    if not isinstance(kernel, MmaKernel):
        return simt_source(kernel)
    return mma_source(kernel) + (finish_source(kernel) if kernel.splits > 1 else "")


def module_source(plans: list[OpPlan]) -> str:
    """One translation unit holding every kernel of ``plans`` (the prelude first)."""
    return PRELUDE + "\n" + "\n".join(kernel_source(k) for plan in plans for k in plan.kernels)
