"""How the code generator's schedule for an op runs, for the fusion cost model."""

from __future__ import annotations

import math
from functools import lru_cache

import sympy

from neoflow.codegen.inner_split import radix_gather
from neoflow.codegen.lattice import split_lattice
from neoflow.fusion.cost import Scheduled
from neoflow.ir import index
from neoflow.ir.expr import Read, Reduce
from neoflow.ir.op import Op, positional_names, positional_variables
from neoflow.ir.simplify import read_offset
from neoflow.targets.cpu.chain import chain_cycles, chain_plan
from neoflow.targets.cpu.flat_depth import flat_depth_plan
from neoflow.targets.cpu.gemm import MR, NR, STEP_CYCLES, blocked_form, domain_points, plan_cycles
from neoflow.targets.cpu.lower import SHORT_SUM_LOOP, in_place_reduction
from neoflow.targets.cpu.staging import staged_plan
from neoflow.targets.cpu.window import windowed

#: Multiply-adds per cycle of one core at the micro-kernel's peak (MR x NR a depth step).
MACS_PER_CYCLE = MR * NR / STEP_CYCLES


def blocked_schedule(op: Op) -> Scheduled | None:
    """How the blocked kernel runs ``op``: its multiply-adds at the fraction of the FMA
    peak its cycle model gives (padding, packing and write-back included: an operand's
    inlined prologue is applied once per element packed, not per multiply-add), or None
    when ``op`` does not run on it."""
    blocked = blocked_form(op)
    if blocked is None:
        return None
    plan = blocked[1]
    cycles = plan_cycles(plan)
    macs = sum(math.prod(piece.op.extent.values()) for piece, mapping in plan.pieces if mapping is not None)
    if not cycles:
        return None
    return Scheduled(min(1.0, macs / MACS_PER_CYCLE / cycles), flops=2.0 * macs)


def schedule(op: Op) -> Scheduled:
    """How ``op`` runs (``schedule_of``), worked out once for all ops that compute alike from
    tensors and over variables of their own (a network's repeated layers, their adjoints, whose
    variables are named after their tensors, the fusion search's many candidate kernels holding
    them: a ResNet-18 training step asks 1675 times, of 726 ops with their tensors named by position
    and 517 with their variables too), in the form ``executor.module_source`` lowers."""
    return _schedule_once(positional_variables(positional_names(op)))


@lru_cache(maxsize=8192)
def _schedule_once(op: Op) -> Scheduled:
    return schedule_of(op)


def schedule_of(op: Op) -> Scheduled:
    """How ``op`` runs: a chain of contractions tiled together (its own
    arithmetic and share of peak), a contraction copied flat along its depth or
    one in two stages (likewise), a depthwise convolution's window (in vector lanes), the
    blocked kernel (share of peak), or a loop nest, vectorised when its innermost
    loop (over the output's last index, when it has no reduction or accumulates
    in place; over the sum's last axis for one floating-point sum) moves every
    access by 0 or 1."""
    chain = chain_plan(op)
    if chain is not None:
        m, n, middle, k = chain.extents
        macs = m * middle * (k + n)
        return Scheduled(min(1.0, macs / MACS_PER_CYCLE / chain_cycles(chain)), flops=2.0 * macs)
    flat = flat_depth_plan(op)
    if flat is not None:
        macs = math.prod(flat.product.extent.values())
        return Scheduled(min(1.0, macs / MACS_PER_CYCLE / flat.cycles), flops=2.0 * macs)
    staged = staged_plan(op)
    if staged is not None:
        slices = 1 if staged.batch is None else op.shape[0] // staged.batch  # the stages are one slice's
        macs = slices * (math.prod(staged.stage.extent.values()) + domain_points(staged.rest))
        return Scheduled(min(1.0, macs / MACS_PER_CYCLE / staged.cycles), flops=2.0 * macs)
    if windowed(op) is not None:  # rows summed in vector registers
        return Scheduled(vector=True)
    blocked = blocked_schedule(op)
    if blocked is not None:
        return blocked
    pieces = split_lattice(op) if op.scatter is None else None
    if pieces is not None and len(pieces) > 1:  # a strided domain runs as dense pieces, each its own loop nest
        return Scheduled(vector=all(schedule(piece.op).vector for piece in pieces if not piece.empty))
    op = radix_gather(op) or op  # lowered as the gather it is
    reductions = [node for node in op.body.walk() if isinstance(node, Reduce)]
    if not reductions or in_place_reduction(op) is not None:
        inner = op.indices[-1] if op.indices else None  # the innermost loop runs over the output's last index
    elif (
        len(reductions) == 1
        and reductions[0].kind == "ReduceAdd"
        and (not op.indices or op.extent[reductions[0].axes[-1]] >= SHORT_SUM_LOOP)
    ):
        inner = reductions[0].axes[-1]  # a sum in vector lanes (each point's, innermost)
    else:
        inner = None
    return Scheduled(vector=inner is not None and _contiguous(op, inner))


def _contiguous(op: Op, variable: str) -> bool:
    """Whether a step of ``variable`` moves every read and the write of ``op`` by
    zero or one element: a loop over it then runs in vector lanes, without gathers."""
    symbol = index.var(variable)
    shapes = {t.name: t.shape for t in op.inputs}
    accesses = [(n.indices, shapes[n.tensor]) for n in op.body.walk() if isinstance(n, Read) and n.tensor in shapes]
    if op.scatter is None:
        accesses.append((tuple(index.var(v) for v in op.indices), op.shape))
    for indices, shape in accesses:
        # a step moves the access by the derivative: 0 or 1 exactly where the offset is affine in the
        # variable with such a coefficient (a derivative, not a polynomial conversion: the planner asks
        # this of every candidate kernel, and sympy's degree() was a sixth of a ResNet's planning time)
        step = sympy.diff(read_offset(indices, shape, op.extent), symbol)
        if step not in (0, 1):
            return False
    return True
