"""Gemm and MatMul as tensor expressions."""

from __future__ import annotations

import numpy as np

from neoflow.errors import UnsupportedOpError
from neoflow.frontend.context import NodeContext, broadcast_index
from neoflow.frontend.registry import converter
from neoflow.ir.index import index_vars


@converter("Gemm")
def gemm(ctx: NodeContext) -> None:
    a, b = ctx.input(0), ctx.input(1)
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))
    ta, tb = int(ctx.attr("transA", 0)), int(ctx.attr("transB", 0))
    (m, k), (k2, n) = ctx.shape(0)[:: -1 if ta else 1], ctx.shape(1)[:: -1 if tb else 1]
    if k != k2:
        raise ctx.fail(f"Gemm: A is {m}x{k} but B is {k2}x{n} after transposes")
    read_a = f"{a}[k0, i0]" if ta else f"{a}[i0, k0]"
    read_b = f"{b}[i1, k0]" if tb else f"{b}[k0, i1]"
    body = f"ReduceAdd({{k0}}, {read_a} * {read_b})"
    if alpha != 1.0:
        body = f"{alpha!r} * {body}"
    if ctx.has_input(2) and beta != 0.0:
        c = ctx.input(2)
        term = f"{c}[{broadcast_index(ctx.shape(2), (m, n), ['i0', 'i1'])}]"
        body += f" + {term}" if beta == 1.0 else f" + {beta!r} * {term}"
    ctx.define(body, (m, n))


@converter("MatMul")
def matmul(ctx: NodeContext) -> None:
    a, b = ctx.input(0), ctx.input(1)
    sa, sb = list(ctx.shape(0)), list(ctx.shape(1))
    a_vec, b_vec = len(sa) == 1, len(sb) == 1
    sa = [1, *sa] if a_vec else sa
    sb = [*sb, 1] if b_vec else sb
    if sa[-1] != sb[-2]:
        raise ctx.fail(f"MatMul: shapes {ctx.shape(0)} and {ctx.shape(1)} do not multiply")
    batch = tuple(np.broadcast_shapes(tuple(sa[:-2]), tuple(sb[:-2])))
    out_shape = [*batch] + ([] if a_vec else [sa[-2]]) + ([] if b_vec else [sb[-1]])
    v = index_vars(len(out_shape))
    nb = len(batch)
    row = None if a_vec else v[nb]
    col = None if b_vec else v[-1]
    ia = broadcast_index(sa[:-2], batch, v[:nb])
    ib = broadcast_index(sb[:-2], batch, v[:nb])
    read_a = f"{a}[{', '.join(x for x in [ia, row, 'k0'] if x)}]"
    read_b = f"{b}[{', '.join(x for x in [ib, 'k0', col] if x)}]"
    ctx.define(f"ReduceAdd({{k0}}, {read_a} * {read_b})", out_shape)


@converter("Einsum")
def einsum(ctx: NodeContext) -> None:
    equation = str(ctx.attr("equation")).replace(" ", "")
    inputs_part, _, output = equation.partition("->")
    terms = inputs_part.split(",")
    if "..." in equation or len(terms) != len(ctx.node.input):
        raise ctx.fail(f"Einsum '{equation}' (ellipsis or a term count mismatch) is not supported", UnsupportedOpError)
    if not _:
        output = "".join(sorted(c for c in set(inputs_part) - {","} if inputs_part.count(c) == 1))
    sizes: dict[str, int] = {}
    for i, term in enumerate(terms):
        for letter, size in zip(term, ctx.shape(i), strict=True):
            if sizes.setdefault(letter, size) != size:
                raise ctx.fail(f"Einsum: '{letter}' has sizes {sizes[letter]} and {size}")
    summed = sorted(set(sizes) - set(output))
    names = {c: f"i{d}" for d, c in enumerate(output)} | {c: f"k{d}" for d, c in enumerate(summed)}
    product = " * ".join(f"{ctx.input(i)}[{', '.join(names[c] for c in term)}]" for i, term in enumerate(terms))
    if summed:
        product = f"ReduceAdd({{{', '.join(f'{names[c]}: {sizes[c]}' for c in summed)}}}, {product})"
    ctx.define(product, [sizes[c] for c in output])
