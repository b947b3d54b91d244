"""Index rewriting of ``codegen.inner_split``: a sum of one term at every point read as the gather it is."""

from __future__ import annotations

import numpy as np
import pytest

import neoflow
from neoflow.codegen.inner_split import radix_gather
from neoflow.ir.expr import Reduce
from neoflow.targets.cpu.lower import lower_op
from tests.on_targets import NEEDS_CC

# a reshape's adjoint through a transpose, as autodiff gives it: ViT's qkv split back into one tensor
QKV = (
    "G[i0, i1, z] = ReduceAdd({h, d | (z - 16*h - d) % 64 == 0}, T[(z - 16*h - d)//64, i0, h, i1, d])",
    {"T": (3, 4, 4, 5, 16)},
    (4, 5, 192),
)


def _op(text: str, shapes: dict, out: tuple | None = None):
    return neoflow.op(text, shapes=shapes, out_shape=out)


def test_each_axis_is_read_as_a_digit_of_the_output_index() -> None:
    op = radix_gather(_op(*QKV))
    assert op is not None and not any(isinstance(n, Reduce) for n in op.body.walk())
    assert op.indices == ("i0", "i1", "z_top", "z_digit0", "z_digit1") and op.shape == (4, 5, 3, 4, 16)
    read = next(iter(op.body.reads()))
    assert [str(i) for i in read.indices] == ["z_top", "i0", "z_digit0", "i1", "z_digit1"]


@pytest.mark.parametrize(
    ("text", "shapes", "out"),
    [
        # the weights leave a gap (16*h with d below 8): several points have no term
        ("G[z] = ReduceAdd({h, d | (z - 16*h - d) % 64 == 0}, T[h, d])", {"T": (4, 8)}, (128,)),
        # the weights exceed the modulus: two terms a point
        ("G[z] = ReduceAdd({h, d | (z - 16*h - d) % 32 == 0}, T[h, d])", {"T": (4, 16)}, (64,)),
        # an offset: not the digits of z itself
        ("G[z] = ReduceAdd({h, d | (z + 1 - 16*h - d) % 64 == 0}, T[h, d])", {"T": (4, 16)}, (128,)),
        # two output indices in the condition
        ("G[y, z] = ReduceAdd({d | (y + z - d) % 16 == 0}, T[d])", {"T": (16,)}, (16, 16)),
    ],
)
def test_sums_of_other_than_one_term_are_left_alone(text: str, shapes: dict, out: tuple) -> None:
    assert radix_gather(_op(text, shapes, out)) is None


@NEEDS_CC
def test_the_gather_computes_what_the_sum_does() -> None:
    op = _op(*QKV)
    code = lower_op(op, "k")
    assert "nf_fdiv" not in code and "v_z_digit1" in code  # affine reads, no division a point
    rng = np.random.default_rng(0)
    inputs = {"T": rng.standard_normal((3, 4, 4, 5, 16)).astype(np.float32)}
    got = neoflow.compile(op, target="cpu").run(inputs)
    got = got[op.name] if isinstance(got, dict) else got
    np.testing.assert_array_equal(got, neoflow.evaluate(op, inputs))
