"""Convolution, pooling, normalisation and LRN as tensor expressions."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from neoflow.errors import UnsupportedOpError
from neoflow.frontend.context import NodeContext
from neoflow.frontend.registry import converter
from neoflow.ir.index import index_vars


def _window(
    ctx: NodeContext, spatial: Sequence[int], kernel: Sequence[int], ceil_mode: bool = False
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Strides, dilations, pads (all begins, then all ends) and output sizes of a
    sliding window (ONNX rules)."""
    k = len(kernel)
    strides = list(ctx.attr("strides", [1] * k))
    dilations = list(ctx.attr("dilations", [1] * k))
    pads = list(ctx.attr("pads", [0] * (2 * k)))
    for name, values, count, low in (
        ("strides", strides, k, 1),
        ("dilations", dilations, k, 1),
        ("pads", pads, 2 * k, 0),
    ):
        if len(values) != count or any(not isinstance(v, int) or v < low for v in values):
            raise ctx.fail(f"{name} {values} should be {count} integers of at least {low} for a {k}-d window")
    if any(not isinstance(v, int) or v < 1 for v in kernel):
        raise ctx.fail(f"kernel {list(kernel)} should be positive integers")
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        pads = [0] * (2 * k)
        for d in range(k):
            out = -(-spatial[d] // strides[d])
            total = max(0, (out - 1) * strides[d] + dilations[d] * (kernel[d] - 1) + 1 - spatial[d])
            small, large = total // 2, total - total // 2
            pads[d], pads[d + k] = (small, large) if auto_pad == "SAME_UPPER" else (large, small)
    elif auto_pad == "VALID":
        pads = [0] * (2 * k)
    elif auto_pad != "NOTSET":
        raise ctx.fail(f"auto_pad '{auto_pad}' is not valid", UnsupportedOpError)
    sizes = []
    for d in range(k):
        span = spatial[d] + pads[d] + pads[d + k] - dilations[d] * (kernel[d] - 1) - 1
        out = (-(-span // strides[d]) if ceil_mode else span // strides[d]) + 1
        if ceil_mode and (out - 1) * strides[d] >= spatial[d] + pads[d]:
            out -= 1
        if out <= 0:
            raise ctx.fail(f"window {kernel[d]} does not fit spatial size {spatial[d]} (dimension {d})")
        sizes.append(out)
    return strides, dilations, pads, sizes


def _taps(outs: Sequence[str], strides, dilations, pads, spatial, taps: Sequence[str]) -> tuple[list[str], str]:
    """Input positions ``o*stride + r*dilation - pad`` and the guard keeping them inside."""
    positions, guards = [], []
    for d, (o, r) in enumerate(zip(outs, taps, strict=True)):
        pos = f"{o}*{strides[d]} + {r}*{dilations[d]} - {pads[d]}"
        positions.append(pos)
        guards.append(f"{pos} >= 0 && {pos} < {spatial[d]}")
    return positions, " && ".join(guards)


def _needs_guard(strides, dilations, pads, sizes, kernel, spatial) -> bool:
    """Whether some window position leaves the input (so reads need a guard)."""
    pads = pads[: len(kernel)]
    return any(
        p != 0 or (o - 1) * s + (k - 1) * dl >= n
        for p, o, s, k, dl, n in zip(pads, sizes, strides, kernel, dilations, spatial, strict=True)
    )


@converter("Conv")
def conv(ctx: NodeContext) -> None:
    x, w = ctx.input(0), ctx.input(1)
    (n, c, *spatial), (m, cg, *kernel) = ctx.shape(0), ctx.shape(1)
    group = int(ctx.attr("group", 1))
    if c != cg * group or m % group:
        raise ctx.fail(f"Conv: {c} input channels, weight {list(ctx.shape(1))} and group {group} do not fit")
    strides, dilations, pads, sizes = _window(ctx, spatial, kernel)
    out = index_vars(2 + len(spatial))
    taps = index_vars(len(kernel), "r")
    positions, guard = _taps(out[2:], strides, dilations, pads, spatial, taps)
    channel = "k0" if group == 1 else f"{out[1]}//{m // group}*{cg} + k0"
    read = f"{x}[{out[0]}, {channel}, {', '.join(positions)}]"
    if _needs_guard(strides, dilations, pads, sizes, kernel, spatial):
        read = f"Select({guard}, {read}, 0)"
    body = f"ReduceAdd({{k0, {', '.join(taps)}}}, {read} * {w}[{out[1]}, k0, {', '.join(taps)}])"
    if ctx.has_input(2):
        body += f" + {ctx.input(2)}[{out[1]}]"
    ctx.define(body, (n, m, *sizes))


@converter("MaxPool", "AveragePool")
def pool(ctx: NodeContext) -> None:
    x = ctx.input(0)
    n, c, *spatial = ctx.shape(0)
    kernel = list(ctx.attr("kernel_shape"))
    if len(ctx.node.output) > 1 and ctx.node.output[1]:
        raise ctx.fail("MaxPool's indices output is not supported", UnsupportedOpError)
    strides, dilations, pads, sizes = _window(ctx, spatial, kernel, bool(ctx.attr("ceil_mode", 0)))
    out = index_vars(2 + len(spatial))
    taps = index_vars(len(kernel), "r")
    positions, guard = _taps(out[2:], strides, dilations, pads, spatial, taps)
    axes = ", ".join(f"{t}: {k}" for t, k in zip(taps, kernel, strict=True))
    read = f"{x}[{out[0]}, {out[1]}, {', '.join(positions)}]"
    guarded = _needs_guard(strides, dilations, pads, sizes, kernel, spatial)
    if ctx.node.op_type == "MaxPool":
        dtype = ctx.tensor(0).dtype
        lowest = "-inf" if dtype.startswith("float") else str(int(np.iinfo(dtype).min))
        body = f"ReduceMax({{{axes}}}, {f'Select({guard}, {read}, {lowest})' if guarded else read})"
    elif not guarded:
        body = f"ReduceAdd({{{axes}}}, {read}) / {math.prod(kernel)}"
    elif int(ctx.attr("count_include_pad", 0)):
        inside = " && ".join(
            f"{p} >= -{pads[d]} && {p} < {spatial[d] + pads[d + len(kernel)]}" for d, p in enumerate(positions)
        )
        body = f"ReduceAdd({{{axes}}}, Select({guard}, {read}, 0)) / ReduceAdd({{{axes}}}, Select({inside}, 1.0, 0.0))"
    else:
        body = f"ReduceAdd({{{axes}}}, Select({guard}, {read}, 0)) / ReduceAdd({{{axes}}}, Select({guard}, 1.0, 0.0))"
    ctx.define(body, (n, c, *sizes))


@converter("GlobalAveragePool", "GlobalMaxPool")
def global_pool(ctx: NodeContext) -> None:
    x = ctx.input(0)
    n, c, *spatial = ctx.shape(0)
    taps = index_vars(len(spatial), "r")
    read = f"{x}[i0, i1, {', '.join(taps)}]"
    if ctx.node.op_type == "GlobalMaxPool":
        body = f"ReduceMax({{{', '.join(taps)}}}, {read})"
    else:
        body = f"ReduceAdd({{{', '.join(taps)}}}, {read}) / {math.prod(spatial)}"
    ctx.define(lambda v: body, (n, c, *[1] * len(spatial)))


@converter("BatchNormalization")
def batch_norm(ctx: NodeContext) -> None:
    """Inference: normalise with the running statistics.  Training: normalise
    with the batch's mean and (biased) variance and update the running
    statistics as ONNX specifies: ``running = running * momentum + batch * (1 - momentum)`` (in a
    file PyTorch wrote, the running variance takes the unbiased batch variance, as the module it
    was exported from does: ONNX's reference takes the biased one).
    A node exported in training mode (``training_mode=1``, as ``torch.onnx.export(...,
    training=TrainingMode.TRAINING)`` writes it) is the same layer: its inference uses the
    running statistics, as the model's eval mode does; its running-statistics outputs exist
    only in a training step, so an inference graph reading them is refused."""
    if not ctx.model.training:
        for k, name in enumerate(ctx.node.output[1:], start=1):
            if name and name in ctx.model.consumers:
                raise ctx.fail(
                    f"output {k} ('{name}', a running statistic) exists only in a training step "
                    "(neoflow.compile with train=...), and the inference graph reads it",
                    UnsupportedOpError,
                )
    eps = float(ctx.attr("epsilon", 1e-5))
    x, scale, bias, mean, var = (ctx.input(i) for i in range(5))
    shape = ctx.shape(0)
    if ctx.model.training:
        mean, var = _batch_statistics(ctx, x, shape, mean, var, float(ctx.attr("momentum", 0.9)))

    def body(v: list[str]) -> str:
        return (
            f"({x}[{', '.join(v)}] - {mean}[{v[1]}]) / sqrt({var}[{v[1]}] + {eps!r}) * {scale}[{v[1]}] + {bias}[{v[1]}]"
        )

    ctx.define(body, shape)


def constant_mean(ctx: NodeContext, mean: str, shape: Sequence[int]) -> str:
    """A copy of ``mean`` that autodiff treats as a constant, for a variance to read: the variance's
    derivative through the mean, -2/n * sum(x - mean), is zero in exact arithmetic, and derived it is
    one more reduction over the activation in the backward pass computing that sum's rounding noise.
    Returns the copy's name."""
    v = ", ".join(index_vars(len(shape)))
    name = ctx.define(f"{mean}[{v}]", shape, name=ctx.model.fresh(f"{mean}_constant"))
    ctx.model.stop_gradients.append(name)
    return name


def _batch_statistics(
    ctx: NodeContext, x: str, shape: Sequence[int], running_mean: str, running_var: str, momentum: float
) -> tuple[str, str]:
    """Define the batch mean and variance per channel and the running statistics'
    next values (outputs 1 and 2 of the node where it has them); returns the
    names of the batch mean and variance."""
    if running_mean not in ctx.model.constants or running_var not in ctx.model.constants:
        raise ctx.fail("training needs the running mean and variance (inputs 3, 4) as initializers", UnsupportedOpError)
    rest = index_vars(len(shape) - 2, "r")
    axes = ", ".join(["r_n", *rest])
    point = f"{x}[r_n, i0{''.join(', ' + r for r in rest)}]"
    count = math.prod(shape) // shape[1]
    out = ctx.output()
    batch_mean = ctx.define(
        f"ReduceAdd({{{axes}}}, {point}) / {count}", (shape[1],), name=ctx.model.fresh(f"{out}_mean")
    )
    centered = f"({point} - {constant_mean(ctx, batch_mean, (shape[1],))}[i0])"
    batch_var = ctx.define(
        f"ReduceAdd({{{axes}}}, {centered} * {centered}) / {count}", (shape[1],), name=ctx.model.fresh(f"{out}_var")
    )
    ctx.model.batch_statistics.extend([batch_mean, batch_var])
    # PyTorch's BatchNorm, which its exporter writes as this node, keeps the unbiased variance as running
    correction = count / (count - 1) if ctx.model.pytorch and count > 1 else 1.0
    for k, (running, batch, factor) in enumerate(
        [(running_mean, batch_mean, 1.0), (running_var, batch_var, correction)], start=1
    ):
        has_output = len(ctx.node.output) > k and ctx.node.output[k]
        target = ctx.output(k) if has_output else ctx.model.fresh(f"{running}_next")
        weight = (1 - momentum) * factor
        ctx.define(f"{running}[i0] * {momentum!r} + {batch}[i0] * {weight!r}", (shape[1],), name=target)
        ctx.model.state_updates[running] = target
    return batch_mean, batch_var


@converter("LRN")
def lrn(ctx: NodeContext) -> None:
    x = ctx.input(0)
    shape = ctx.shape(0)
    size = int(ctx.attr("size"))
    alpha, beta, bias = float(ctx.attr("alpha", 1e-4)), float(ctx.attr("beta", 0.75)), float(ctx.attr("bias", 1.0))
    low = (size - 1) // 2

    def body(v: list[str]) -> str:
        rest = ", ".join(v[2:])
        channel = f"{v[1]} + r0 - {low}"
        square = f"{x}[{v[0]}, {channel}, {rest}] * {x}[{v[0]}, {channel}, {rest}]"
        total = f"ReduceAdd({{r0: {size}}}, Select({channel} >= 0 && {channel} < {shape[1]}, {square}, 0))"
        return f"{x}[{', '.join(v)}] / pow({bias!r} + {alpha / size!r} * {total}, {beta!r})"

    ctx.define(body, shape)


@converter("LayerNormalization")
def layer_norm(ctx: NodeContext) -> None:
    _normalize(ctx, int(ctx.attr("axis", -1)) % len(ctx.shape(0)), float(ctx.attr("epsilon", 1e-5)), "last")


@converter("InstanceNormalization")
def instance_norm(ctx: NodeContext) -> None:
    _normalize(ctx, 2, float(ctx.attr("epsilon", 1e-5)), "channel")


def _normalize(ctx: NodeContext, axis: int, eps: float, affine: str) -> None:
    """(x - mean) / sqrt(var + eps) * scale + bias over the axes from ``axis`` on;
    ``scale``/``bias`` are indexed by those axes (``last``) or by the channel."""
    x, shape = ctx.input(0), ctx.shape(0)
    axes = list(range(axis, len(shape)))
    count = math.prod(shape[a] for a in axes)
    v = index_vars(len(shape))
    kept = [n if d < axis else "0" for d, n in enumerate(v)]
    reduced = [n if d < axis else f"k{d}" for d, n in enumerate(v)]
    red_axes = ", ".join(f"k{d}" for d in axes)
    mean_name = ctx.model.fresh(f"{ctx.output()}_mean")
    keep_shape = [s if d < axis else 1 for d, s in enumerate(shape)]
    ctx.define(f"ReduceAdd({{{red_axes}}}, {x}[{', '.join(reduced)}]) / {count}", keep_shape, name=mean_name)
    if len(ctx.node.output) > 1 and ctx.node.output[1]:
        ctx.define(f"{mean_name}[{', '.join(v)}]", keep_shape, k=1)
    centred = ctx.define(
        f"{x}[{', '.join(v)}] - {mean_name}[{', '.join(kept)}]", shape, name=ctx.model.fresh(f"{ctx.output()}_centred")
    )
    deviation = f"({x}[{', '.join(reduced)}] - {constant_mean(ctx, mean_name, keep_shape)}[{', '.join(kept)}])"
    var_name = ctx.define(
        f"ReduceAdd({{{red_axes}}}, {deviation} * {deviation}) / {count}",
        keep_shape,
        name=ctx.model.fresh(f"{ctx.output()}_var"),
    )
    if affine == "last":
        param = ", ".join(v[axis:])
        scale_shape = ctx.shape(1)
        param = ", ".join(v[len(shape) - len(scale_shape) :])
    else:
        param = v[1]
    if len(ctx.node.output) > 2 and ctx.node.output[2]:
        ctx.define(f"1 / sqrt({var_name}[{', '.join(v)}] + {eps!r})", keep_shape, k=2)
    body = f"{centred}[{', '.join(v)}] / sqrt({var_name}[{', '.join(kept)}] + {eps!r}) * {ctx.input(1)}[{param}]"
    if ctx.has_input(2):
        body += f" + {ctx.input(2)}[{param}]"
    ctx.define(body, shape)


@converter("ConvTranspose")
def conv_transpose(ctx: NodeContext) -> None:
    x, w = ctx.input(0), ctx.input(1)
    (n, c, *spatial), (c2, mg, *kernel) = ctx.shape(0), ctx.shape(1)
    group = int(ctx.attr("group", 1))
    k = len(kernel)
    strides = list(ctx.attr("strides", [1] * k))
    dilations = list(ctx.attr("dilations", [1] * k))
    extra = list(ctx.attr("output_padding", [0] * k))
    pads = list(ctx.attr("pads", [0] * (2 * k)))
    wanted = ctx.attr("output_shape")
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    full = [(spatial[d] - 1) * strides[d] + dilations[d] * (kernel[d] - 1) + 1 + extra[d] for d in range(k)]
    if wanted is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        target = list(wanted)[-k:] if wanted is not None else [spatial[d] * strides[d] for d in range(k)]
        for d in range(k):
            total = full[d] - target[d]
            small, large = total // 2, total - total // 2
            pads[d], pads[d + k] = (small, large) if auto_pad == "SAME_UPPER" else (large, small)
    sizes = [full[d] - pads[d] - pads[d + k] for d in range(k)]
    out = index_vars(2 + k)
    taps = index_vars(k, "r")
    cg = c // group
    conditions, positions = [], []
    for d in range(k):
        num = f"{out[2 + d]} + {pads[d]} - {taps[d]}*{dilations[d]}"
        positions.append(f"({num})//{strides[d]}")
        if strides[d] > 1:
            conditions.append(f"({num})%{strides[d]} == 0")
        conditions.append(f"{num} >= 0 && ({num})//{strides[d]} < {spatial[d]}")
    channel = "k0" if group == 1 else f"{out[1]}//{mg}*{cg} + k0"
    out_channel = out[1] if group == 1 else f"{out[1]}%{mg}"
    body = (
        f"ReduceAdd({{k0: {cg}, {', '.join(taps)} | {' && '.join(conditions)}}}, "
        f"{x}[{out[0]}, {channel}, {', '.join(positions)}] * {w}[{channel}, {out_channel}, {', '.join(taps)}])"
    )
    if ctx.has_input(2):
        body += f" + {ctx.input(2)}[{out[1]}]"
    if c2 != c:
        raise ctx.fail(f"ConvTranspose: weight {list(ctx.shape(1))} does not match {c} input channels")
    ctx.define(body, (n, mg * group, *sizes))
