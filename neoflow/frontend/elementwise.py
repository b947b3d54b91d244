"""Element-wise ONNX ops (with numpy broadcasting) as tensor expressions."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from neoflow.errors import UnsupportedOpError
from neoflow.frontend.context import ONNX_DTYPES, NodeContext
from neoflow.frontend.registry import converter
from neoflow.ir import dtypes as dt
from neoflow.ir.op import Tensor

UNARY = {
    "Relu": "max({0}, 0)",
    "Abs": "abs({0})",
    "Neg": "-{0}",
    "Sqrt": "sqrt({0})",
    "Exp": "exp({0})",
    "Log": "log({0})",
    "Tanh": "tanh({0})",
    "Sigmoid": "sigmoid({0})",
    "Reciprocal": "1 / {0}",
    "Softplus": "log(1 + exp({0}))",
    "Identity": "{0}",
    "Not": "!{0}",
    "Erf": "erf({0})",
}
BINARY = {
    "Add": "{0} + {1}",
    "Sub": "{0} - {1}",
    "Mul": "{0} * {1}",
    "Div": "{0} / {1}",
    "Pow": "pow({0}, {1})",
    "Equal": "{0} == {1}",
    "Less": "{0} < {1}",
    "Greater": "{0} > {1}",
    "LessOrEqual": "{0} <= {1}",
    "GreaterOrEqual": "{0} >= {1}",
    "And": "{0} && {1}",
    "Or": "{0} || {1}",
    "PRelu": "Select({0} >= 0, {0}, {0} * {1})",
}


@converter(*[k for k, v in UNARY.items() if v])
def unary(ctx: NodeContext) -> None:
    ctx.elementwise(UNARY[ctx.node.op_type], [0])


@converter(*BINARY)
def binary(ctx: NodeContext) -> None:
    op = ctx.node.op_type
    dtype = ctx.tensor(0).dtype
    if op == "Div" and not dtype.startswith("float"):  # integer division truncates toward zero
        ctx.elementwise("Select({0} % {1} != 0 && ({0} < 0) != ({1} < 0), {0} // {1} + 1, {0} // {1})", [0, 1])
    elif op == "Pow" and not dtype.startswith("float"):
        ctx.elementwise(f"{dtype}(pow({{0}}, {{1}}))", [0, 1], dtype=dtype)
    else:
        ctx.elementwise(BINARY[op], [0, 1])


@converter("Dropout")
def dropout(ctx: NodeContext) -> None:
    """Inference: the identity (the mask keeps everything).  Training: a fresh
    uniform noise input per run; elements whose noise is below the ratio are
    dropped and the rest scaled by 1 / (1 - ratio)."""
    if ctx.has_input(1) and ctx.constant(1) is None:
        raise ctx.fail("the dropout ratio (input 1) must be a constant", UnsupportedOpError)
    ratio = float(ctx.constant(1)) if ctx.has_input(1) else float(ctx.attr("ratio", 0.5))
    if not 0 <= ratio < 1:
        raise ctx.fail(f"the dropout ratio must be in [0, 1), got {ratio}")
    shape = ctx.shape(0)
    wants_mask = len(ctx.node.output) > 1 and ctx.node.output[1]
    if not ctx.model.training or ratio == 0:
        ctx.elementwise("{0}", [0])
        if wants_mask:
            ctx.set_constant(1, np.ones(shape, dtype=bool))
        return
    noise = ctx.model.fresh(f"{ctx.output()}_noise")
    ctx.model.tensors[noise] = Tensor(noise, shape, "float32")
    ctx.model.noise_inputs.append(noise)
    x = ctx.input(0)
    ctx.define(lambda v: f"Select({noise}[{', '.join(v)}] >= {ratio!r}, {x}[{', '.join(v)}] / {1 - ratio!r}, 0)", shape)
    if wants_mask:
        ctx.define(lambda v: f"{noise}[{', '.join(v)}] >= {ratio!r}", shape, k=1, dtype="bool")


@converter("LeakyRelu")
def leaky_relu(ctx: NodeContext) -> None:
    alpha = float(ctx.attr("alpha", 0.01))
    ctx.elementwise(f"Select({{0}} >= 0, {{0}}, {alpha!r} * {{0}})", [0])


@converter("Elu")
def elu(ctx: NodeContext) -> None:
    alpha = float(ctx.attr("alpha", 1.0))
    ctx.elementwise(f"Select({{0}} > 0, {{0}}, {alpha!r} * (exp({{0}}) - 1))", [0])


@converter("Selu")
def selu(ctx: NodeContext) -> None:
    alpha = float(ctx.attr("alpha", 1.67326319217681884765625))
    gamma = float(ctx.attr("gamma", 1.05070102214813232421875))
    ctx.elementwise(f"{gamma!r} * Select({{0}} > 0, {{0}}, {alpha!r} * (exp({{0}}) - 1))", [0])


@converter("HardSigmoid")
def hard_sigmoid(ctx: NodeContext) -> None:
    alpha, beta = float(ctx.attr("alpha", 0.2)), float(ctx.attr("beta", 0.5))
    ctx.elementwise(f"max(min({alpha!r} * {{0}} + {beta!r}, 1), 0)", [0])


@converter("Clip")
def clip(ctx: NodeContext) -> None:
    if ctx.opset < 11:
        low, high = ctx.attr("min"), ctx.attr("max")
    else:
        low = ctx.require_constant(1, "Clip's min").item() if ctx.has_input(1) else None
        high = ctx.require_constant(2, "Clip's max").item() if ctx.has_input(2) else None
    text = "{0}"
    as_int = not ctx.tensor(0).dtype.startswith("float")
    if low is not None:
        text = f"max({text}, {int(low) if as_int else float(low)!r})"
    if high is not None:
        text = f"min({text}, {int(high) if as_int else float(high)!r})"
    ctx.elementwise(text, [0])


@converter("Sum", "Mean", "Max", "Min")
def variadic(ctx: NodeContext) -> None:
    n = len(ctx.node.input)
    op = ctx.node.op_type
    if op in ("Max", "Min"):
        text = "{0}"
        for i in range(1, n):
            text = f"{op.lower()}({text}, {{{i}}})"
    else:
        text = " + ".join(f"{{{i}}}" for i in range(n))
        if op == "Mean":
            text = f"({text}) / {n}"
    ctx.elementwise(text)


@converter("Where")
def where(ctx: NodeContext) -> None:
    ctx.elementwise("Select({0}, {1}, {2})")


@converter("Cast")
def cast(ctx: NodeContext) -> None:
    to = ONNX_DTYPES.get(int(ctx.attr("to")))
    if to is None:
        raise ctx.fail(f"Cast to ONNX type {ctx.attr('to')} is not supported", UnsupportedOpError)
    value = "{0}"
    if to.startswith("float8") and int(ctx.attr("saturate", 1)):  # out-of-range values clamp to the largest finite
        largest = float(ml_dtypes.finfo(dt.DTYPES[to]).max)
        value = f"max(min({{0}}, {largest!r}), {-largest!r})"
    ctx.elementwise(f"{to}({value})", [0], dtype=to)


@converter("Mod")
def mod(ctx: NodeContext) -> None:
    if int(ctx.attr("fmod", 0)):
        raise ctx.fail("Mod with fmod=1 is not supported", UnsupportedOpError)
    ctx.elementwise("{0} % {1}", [0, 1])


@converter("CastLike")
def cast_like(ctx: NodeContext) -> None:
    to = ctx.tensor(1).dtype
    ctx.elementwise(f"{to}({{0}})", [0], dtype=to)


@converter("Gelu")
def gelu(ctx: NodeContext) -> None:
    if ctx.attr("approximate", "none") == "tanh":
        ctx.elementwise("0.5 * {0} * (1 + tanh(0.7978845608028654 * ({0} + 0.044715 * {0} * {0} * {0})))", [0])
    else:
        ctx.elementwise("0.5 * {0} * (1 + erf({0} * 0.7071067811865476))", [0])
