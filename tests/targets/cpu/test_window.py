"""Depthwise convolutions over zero-bordered planes (``targets.cpu.window``): where the forms are
taken and where not, and compiled results equal to the interpreter's (forward at stride 1 and 2,
input adjoint, weight gradient, epilogues and prologues, short rows, wide windows)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import neoflow
from neoflow.codegen.lattice import split_lattice
from neoflow.ir import index
from neoflow.ir.expr import Binary, Const, Read, Select
from neoflow.ir.op import Tensor
from neoflow.targets.cpu.lower import lower_op, lowering_paths
from neoflow.targets.cpu.window import window_gradient_plan, window_plan, windowed
from tests.on_targets import NEEDS_CC, assert_compiled_matches_interpreter

PADDED = "Select(h*{s} + r >= {p} && h*{s} + r < {H} + {p} && w*{s} + q >= {p} && w*{s} + q < {W} + {p}, {read}, 0)"


def depthwise(
    size: int = 8, stride: int = 1, window: int = 3, channels: int = 3, epilogue: str = "{}", plane: str = ""
):
    """A padded depthwise convolution of ``size`` x ``size`` planes (``plane``: a prologue's text around
    the read, ``{}`` the read, inside the padding guard as an inlined producer is)."""
    pad = window // 2
    out = (size + 2 * pad - window) // stride + 1
    read = f"X[n, c, h*{stride} + r - {pad}, w*{stride} + q - {pad}]"
    read = PADDED.format(s=stride, p=pad, H=size, W=size, read=plane.format(read) if plane else read)
    text = "Y[n, c, h, w] = " + epilogue.format(f"ReduceAdd({{r, q}}, {read} * K[c, r, q])")
    shapes = {"X": (2, 3, size, size), "K": (3, window, window), "B": (3,)}
    if "B[" not in text:
        del shapes["B"]
    return neoflow.op(text, shapes=shapes, out_shape=(2, 3, out, out))


def test_a_padded_depthwise_convolution_takes_the_window_path() -> None:
    op = depthwise()
    plan = window_plan(op)
    assert plan is not None and "window" in lowering_paths(op)
    assert (plan.plane.rows.tap, plan.plane.cols.tap) == ("r", "q") and (
        plan.plane.rows.lowest,
        plan.plane.cols.lowest,
    ) == (-1, -1)
    assert plan.plane.vectors == 1 and plan.plane.pitch == 8 + 2 and plan.plane.buffer_rows == 10
    assert "nf_wv" in lower_op(op, "k")  # the rows are summed in vectors, not the loop nest's passes


def test_stride_two_splits_the_plane_into_two_column_phases() -> None:
    plan = window_plan(depthwise(size=8, stride=2))
    assert plan is not None and plan.plane.cols.stride == plan.plane.rows.stride == 2
    assert plan.plane.floats == 2 * plan.plane.buffer_rows * plan.plane.pitch


def test_the_plane_is_copied_without_a_test_per_element() -> None:
    # the columns inside the tensor are one loop with no condition (where a clamp inlined into the copy
    # is put in vector lanes), the border's columns and rows are zeros of their own loops
    code = lower_op(depthwise(size=8, stride=2, plane="min(max({}, 0), 6)"), "k")
    fill = code.split("for (int64_t y_ = 0;", 1)[1].split("for (int64_t q_ = 0;", 1)[0]
    assert "for (int64_t x_ = 0; x_ < 1; ++x_) to_[x_] = 0.0f;" in fill
    assert "for (int64_t x_ = 1; x_ < 9; ++x_) {" in fill and "for (int64_t x_ = 9; x_ < 18; ++x_)" in fill
    assert " ? " not in fill.split("for (int64_t x_ = 1; x_ < 9; ++x_) {", 1)[1].split("}", 1)[0]


def test_forms_it_does_not_take() -> None:
    # a full convolution: its channel sum is not a unit axis
    conv = neoflow.op(
        "Y[n, k, h, w] = ReduceAdd({c, r, q}, X[n, c, h + r, w + q] * K[k, c, r, q])",
        shapes={"X": (2, 3, 8, 8), "K": (4, 3, 3, 3)},
    )
    assert window_plan(conv) is None
    # a guard that is not the read's bounds (it drops terms inside the tensor)
    cut = neoflow.op(
        "Y[n, c, h, w] = ReduceAdd({r, q}, Select(h + r >= 2 && h + r <= 8 && w + q >= 1 && w + q <= 8,"
        " X[n, c, h + r - 1, w + q - 1], 0) * K[c, r, q])",
        shapes={"X": (2, 3, 8, 8), "K": (3, 3, 3)},
        out_shape=(2, 3, 8, 8),
    )
    assert window_plan(cut) is None
    # stride 3 and a weight that reads the output's row
    assert window_plan(depthwise(size=9, stride=3)) is None
    rowwise = neoflow.op(
        "Y[n, c, h, w] = ReduceAdd({r, q}, X[n, c, h + r, w + q] * K[c, h, r, q])",
        shapes={"X": (2, 3, 8, 8), "K": (3, 6, 3, 3)},
    )
    assert window_plan(rowwise) is None
    # the input adjoint of a stride-2 one (a parity lattice)
    assert window_plan(neoflow.grad(depthwise(stride=2))["X"]) is None


def test_the_input_adjoint_of_a_stride_one_depthwise_convolution_takes_it() -> None:
    adjoint = neoflow.grad(depthwise())["X"]
    plan = window_plan(adjoint)
    assert plan is not None and plan.plane.rows.coefficient == plan.plane.cols.coefficient == -1


@NEEDS_CC
@pytest.mark.parametrize(
    "op",
    [
        depthwise(),
        depthwise(size=8, stride=2),
        depthwise(size=7, stride=2),
        depthwise(size=4),
        depthwise(size=21, window=5, epilogue="min(max({} + B[c], 0), 6)"),
        depthwise(size=9, plane="max({}, 0)"),
        depthwise(size=9, stride=2, plane="min(max({}, 0), 6)"),
        neoflow.grad(depthwise(size=10))["X"],
        neoflow.grad(depthwise(size=6, window=5))["X"],
    ],
    ids=[
        *("3x3", "stride2", "stride2-odd", "4x4", "5x5-relu6", "prologue", "stride2-relu6-prologue"),
        *("adjoint", "adjoint-5x5"),
    ],
)
def test_compiled_window_kernels_match_the_interpreter(op) -> None:
    assert windowed(op) is not None
    assert_compiled_matches_interpreter(op, seed=3)


def test_the_weight_gradient_keeps_a_sum_per_tap() -> None:
    gradient = neoflow.grad(depthwise())["K"]
    assert window_plan(gradient) is None
    plan = window_gradient_plan(gradient)
    assert plan is not None and plan.plane.taps == 9
    assert [v for v, _ in plan.outer] == ["c"] and [a for a, _ in plan.batch] == ["n"]
    assert (plan.plane.rows.position, plan.plane.cols.position) == ("h", "w")
    code = lower_op(gradient, "k")
    assert code.count("g_ * *(const nf_wv *)") == 9  # one vector FMA a tap per vector of a gradient row


@NEEDS_CC
@pytest.mark.parametrize(
    ("size", "stride", "window"),
    [(8, 1, 3), (7, 1, 3), (8, 2, 3), (9, 2, 3), (12, 1, 5), (4, 1, 3)],
    ids=["3x3", "odd", "stride2", "stride2-odd", "5x5", "4x4"],
)
def test_compiled_weight_gradients_match_the_interpreter(size: int, stride: int, window: int) -> None:
    gradient = neoflow.grad(depthwise(size=size, stride=stride, window=window))["K"]
    assert window_gradient_plan(gradient) is not None
    assert_compiled_matches_interpreter(gradient, seed=5)


@NEEDS_CC
def test_a_momentum_update_is_the_weight_gradients_epilogue() -> None:
    update = neoflow.op(
        "M2[c, r, q] = 0.9 * M[c, r, q] + ReduceAdd({n, h, w}, G[n, c, h, w] * "
        "Select(h + r >= 1 && h + r <= 8 && w + q >= 1 && w + q <= 8, X[n, c, h + r - 1, w + q - 1], 0))",
        shapes={"M": (3, 3, 3), "G": (2, 3, 8, 8), "X": (2, 3, 8, 8)},
    )
    assert window_gradient_plan(update) is not None
    assert_compiled_matches_interpreter(update, seed=7)


@NEEDS_CC
@pytest.mark.parametrize("size", [8, 9])
def test_a_stride_two_input_adjoints_lattice_pieces_are_windows(size: int) -> None:
    adjoint = neoflow.grad(depthwise(size=size, stride=2))["X"]
    pieces = split_lattice(adjoint)
    assert len(pieces) == 4 and all(windowed(piece.op) is not None for piece in pieces if not piece.empty)
    code = lower_op(adjoint, "k")
    # one loop over the planes, each plane's four pieces in turn (not a pass over the output a piece)
    assert "nf_wv" in code and code.count("for (int64_t p_ = 0;") == 1 and code.count("k_windows(out") == 1
    assert code.count("NF_SCRATCH(float, plane_,") == 4
    assert_compiled_matches_interpreter(adjoint, seed=11)
    # with a ReLU6's mask as its epilogue, as a training step fuses it
    point = tuple(index.var(v) for v in adjoint.indices)
    mask = Select(Binary("<", Read("A", point), Const(6)), Const(1), Const(0))
    activation = Tensor("A", adjoint.shape, "float32")
    masked = replace(adjoint, body=Binary("*", mask, adjoint.body), inputs=(*adjoint.inputs, activation))
    assert_compiled_matches_interpreter(masked, seed=12)


def test_a_full_convolutions_weight_gradient_is_left_to_the_blocked_kernel() -> None:
    conv = neoflow.op(
        "Y[n, k, p, q] = ReduceAdd({c, r, s}, X[n, c, p + r, q + s] * W[k, c, r, s])",
        shapes={"X": (2, 3, 10, 10), "W": (4, 3, 3, 3)},
    )
    assert windowed(neoflow.grad(conv)["W"]) is None  # each input plane is read by every output channel
