"""Resize and Upsample (nearest and linear) as tensor expressions.

The source position of every output coordinate is computed at import time
(ONNX's coordinate transformation modes), per axis, into small constant tables:
nearest reads ``X[.., table[i], ..]``; linear mixes the two neighbours with
constant weights.  A resized axis is thus a gather through a constant index
table (its adjoint is a scatter-add); unchanged axes stay plain."""

from __future__ import annotations

import math

import numpy as np

from neoflow.errors import UnsupportedOpError
from neoflow.frontend.context import NodeContext
from neoflow.frontend.registry import converter


def _source(mode: str, out: np.ndarray, scale: float, size_in: int, size_out: int) -> np.ndarray:
    if mode == "half_pixel":
        return (out + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        adjustment = size_out / (scale * size_in)
        offset = size_in / 2 * (1 - adjustment)
        return offset + (out + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (out + 0.5) / scale - 0.5 if size_out > 1 else np.zeros_like(out)
    if mode == "align_corners":
        return out * (size_in - 1) / (size_out - 1) if size_out > 1 else np.zeros_like(out)
    if mode == "asymmetric":
        return out / scale
    raise UnsupportedOpError(f"coordinate_transformation_mode '{mode}' is not supported")


def _nearest(x: np.ndarray, rule: str) -> np.ndarray:
    if rule == "floor":
        return np.floor(x)
    if rule == "ceil":
        return np.ceil(x)
    half = np.isclose(x - np.floor(x), 0.5)
    if rule == "round_prefer_ceil":
        return np.where(half, np.ceil(x), np.round(x))
    return np.where(half, np.floor(x), np.round(x))  # round_prefer_floor


def _taps(
    ctx: NodeContext, mode: str, rule: str, source: np.ndarray, size: int
) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """(source index, weight) tables of every tap of one axis; weight None means 1."""
    if mode == "nearest" or size == 1:
        pick = _nearest(source, rule) if mode == "nearest" else np.zeros_like(source)
        return [(np.clip(pick, 0, size - 1), None)]
    if mode == "linear":
        source = np.clip(source, 0, size - 1)
        low = np.floor(source)
        frac = source - low
        return [(low, 1 - frac), (np.minimum(low + 1, size - 1), frac)]
    a = float(ctx.attr("cubic_coeff_a", -0.75))
    base = np.floor(source)
    t = source - base
    distances = [t + 1, t, 1 - t, 2 - t]
    weights = [
        ((a * s - 5 * a) * s + 8 * a) * s - 4 * a if k in (0, 3) else ((a + 2) * s - (a + 3)) * s * s + 1
        for k, s in enumerate(distances)
    ]
    indices = [base + offset for offset in (-1, 0, 1, 2)]
    if int(ctx.attr("exclude_outside", 0)):
        inside = [(i >= 0) & (i <= size - 1) for i in indices]
        weights = [np.where(m, w, 0.0) for w, m in zip(weights, inside, strict=True)]
        total = sum(weights)
        weights = [w / total for w in weights]
    return [(np.clip(i, 0, size - 1), w) for i, w in zip(indices, weights, strict=True)]


@converter("Resize", "Upsample")
def resize(ctx: NodeContext) -> None:
    shape = ctx.shape(0)
    rank = len(shape)
    policy = "stretch"
    if ctx.node.op_type == "Upsample":
        scales = list(ctx.attr("scales")) if ctx.opset < 9 else list(ctx.require_constant(1, "Upsample's scales"))
        sizes = None
    else:
        scales_input = 2 if ctx.opset >= 11 else 1
        scales = ctx.constant(scales_input) if ctx.has_input(scales_input) else None
        scales = None if scales is None or scales.size == 0 else [float(s) for s in scales]
        sizes = ctx.constant(3) if ctx.has_input(3) else None
        sizes = None if sizes is None or sizes.size == 0 else [int(s) for s in sizes]
        axes = ctx.attr("axes")
        if axes is not None:  # scales/sizes name only these axes; the others stay
            axes = [int(a) % rank for a in axes]
            if scales is not None:
                full = [1.0] * rank
                for a, value in zip(axes, scales, strict=True):
                    full[a] = value
                scales = full
            if sizes is not None:
                full_sizes = list(shape)
                for a, value in zip(axes, sizes, strict=True):
                    full_sizes[a] = value
                sizes = full_sizes
        policy = ctx.attr("keep_aspect_ratio_policy", "stretch")
        if sizes is not None and policy != "stretch":
            chosen = axes if axes is not None else list(range(rank))
            ratios = [sizes[a] / shape[a] for a in chosen]
            ratio = min(ratios) if policy == "not_larger" else max(ratios)
            sizes = [round(ratio * shape[a]) if a in chosen else shape[a] for a in range(rank)]
            scales = [ratio if a in chosen else 1.0 for a in range(rank)]
    if sizes is not None and not (ctx.node.op_type == "Resize" and policy != "stretch"):
        scales = [o / i for o, i in zip(sizes, shape, strict=True)]
    elif scales is not None:
        sizes = [math.floor(s * i) for s, i in zip(scales, shape, strict=True)]
    else:
        raise ctx.fail("Resize needs constant scales or sizes", UnsupportedOpError)
    mode = ctx.attr("mode", "nearest")
    if mode not in ("nearest", "linear", "cubic"):
        raise ctx.fail(f"Resize mode '{mode}' is not supported", UnsupportedOpError)
    if int(ctx.attr("antialias", 0)) and any(s < 1 for s in scales):
        raise ctx.fail("Resize with antialias when downsampling is not supported", UnsupportedOpError)
    legacy = ctx.node.op_type == "Upsample" or ctx.opset < 11
    transform = "asymmetric" if legacy else ctx.attr("coordinate_transformation_mode", "half_pixel")
    rule = "floor" if legacy else ctx.attr("nearest_mode", "round_prefer_floor")
    x = ctx.input(0)
    terms: list[tuple[list[str], list[str]]] = [([], [])]  # (indices, weight factors) per term
    for d in range(rank):
        if sizes[d] == shape[d] and scales[d] == 1.0:
            terms = [([*idx, f"i{d}"], w) for idx, w in terms]
            continue
        source = _source(transform, np.arange(sizes[d], dtype=np.float64), scales[d], shape[d], sizes[d])
        taps = _taps(ctx, mode, rule, source, shape[d])
        names = []
        for k, (index, weight) in enumerate(taps):
            table = ctx.constant_table(f"idx{d}_{k}", index, "int64")
            names.append((table, None if weight is None else ctx.constant_table(f"w{d}_{k}", weight, "float32")))
        terms = [
            ([*idx, f"{table}[i{d}]"], w if weight is None else [*w, f"{weight}[i{d}]"])
            for idx, w in terms
            for table, weight in names
        ]
    body = " + ".join(" * ".join([f"{x}[{', '.join(idx)}]", *w]) for idx, w in terms)
    ctx.define(body, sizes)
