"""Depthwise convolutions over zero-bordered planes (``targets.cpu.window``): where the form is
taken and where not, and compiled results equal to the interpreter's (forward at stride 1 and 2,
input adjoint, epilogues and prologues, short rows, wide windows)."""

from __future__ import annotations

import pytest

import neoflow
from neoflow.targets.cpu.lower import lower_op, lowering_paths
from neoflow.targets.cpu.window import window_plan
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
    assert (plan.rows.tap, plan.cols.tap) == ("r", "q") and (plan.rows.lowest, plan.cols.lowest) == (-1, -1)
    assert plan.vectors == 1 and plan.pitch == 8 + 2 and plan.plane_rows == 10
    assert "nf_wv" in lower_op(op, "k")  # the rows are summed in vectors, not the loop nest's passes


def test_stride_two_splits_the_plane_into_two_column_phases() -> None:
    plan = window_plan(depthwise(size=8, stride=2))
    assert plan is not None and plan.cols.stride == plan.rows.stride == 2
    assert plan.plane_floats == 2 * plan.plane_rows * plan.pitch


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
    assert plan is not None and plan.rows.coefficient == plan.cols.coefficient == -1


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
        neoflow.grad(depthwise(size=10))["X"],
        neoflow.grad(depthwise(size=6, window=5))["X"],
    ],
    ids=["3x3", "stride2", "stride2-odd", "4x4", "5x5-relu6", "prologue", "adjoint", "adjoint-5x5"],
)
def test_compiled_window_kernels_match_the_interpreter(op) -> None:
    assert window_plan(op) is not None
    assert_compiled_matches_interpreter(op, seed=3)
