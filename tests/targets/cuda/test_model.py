"""The tensor-core model against the interpreter: every tiling, precision and split of the kernel plans."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import sympy

import neoflow
from neoflow.codegen.hardware import TENSOR_CORE
from neoflow.codegen.implicit_gemm import gemm_views
from neoflow.ir import dtypes as dt
from neoflow.ir import index
from neoflow.targets.cuda.emit import mma_source
from neoflow.targets.cuda.model import round_to, run_plan
from neoflow.targets.cuda.plan import (
    TILE_CHOICES,
    TUNER_TILES,
    WGMMA_TILES,
    MmaKernel,
    OpPlan,
    make_kernel,
    output_parts,
    plan_op,
    producer_twin,
    retiled,
    swizzle128,
    tensor_core_plan,
    whole_copies,
)
from tests.targets.cuda.gpu_cases import (
    WGMMA_PRODUCTS,
    all_ops,
    capsule,
    conv_relu,
    inputs_for,
    masked_gradient,
    wgmma_plan,
)

PRECISIONS = ("fp16", "tf32", "bf16")
SHAPES = {"G": (40, 48), "A": (40, 48), "W": (48, 24)}
#: operands rounded to values every precision holds exactly (bf16's 8 bits of mantissa): then only
#: the order of the fp32 sums differs from the interpreter's
EXACT = "bfloat16"


def _exact_inputs(op, seed: int = 0) -> dict[str, np.ndarray]:
    return {name: round_to(value, EXACT) for name, value in inputs_for(op, seed).items()}


def _close(got: np.ndarray, want: np.ndarray, tolerance: float = 2e-6) -> None:
    assert not np.isnan(got).any(), "an element no kernel wrote (or no thread loaded)"
    scale = max(float(np.abs(want).max()), 1e-30)
    assert float(np.abs(got - want).max()) <= tolerance * scale


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stride", [1, 2])
def test_capsule_conv_and_adjoints_match_the_interpreter(stride: int, precision: str) -> None:
    for op in all_ops(capsule(stride)):
        plan = plan_op(op, "k", precision)
        assert all(isinstance(k, MmaKernel) for k in plan.kernels), f"{op.name} should run on the tensor cores"
        inputs = _exact_inputs(op)
        _close(run_plan(plan, inputs), neoflow.evaluate(op, inputs))


@pytest.mark.parametrize("tiles", TILE_CHOICES, ids=lambda t: f"{t.block_m}x{t.block_n}w{t.warps_m}x{t.warps_n}")
def test_every_tiling_and_split_computes_the_same(tiles) -> None:
    op = neoflow.grad(capsule(2, batch=3, channels=16, out=6))["W"]  # dW: a long depth, splittable
    inputs = _exact_inputs(op, seed=3)
    want = neoflow.evaluate(op, inputs)
    plan = plan_op(op, "k", "fp16")
    for splits in (1, 3):
        kernels = tuple(dataclasses.replace(k, tiles=tiles, splits=splits) for k in plan.kernels)
        _close(run_plan(OpPlan(op, kernels, splits > 1 or plan.zero_first), inputs), want)


@pytest.mark.parametrize("precision, dtype", [("tf32", "float32"), ("fp16", "float16")])
def test_warps_slicing_each_depth_tile_sum_their_slices_to_the_same(precision: str, dtype: str) -> None:
    # the tuner's warp layouts: sets of warps each multiply a slice of every depth tile into their own
    # accumulators, added through shared memory at the end (lattice pieces and depth splits included)
    sliced = 0
    for op in all_ops(capsule(2, batch=3, channels=16, out=6, dtype=dtype)):
        inputs = {name: value.astype(dt.numpy_dtype(dtype)) for name, value in _exact_inputs(op, seed=5).items()}
        plan = plan_op(op, "k", precision)
        want = run_plan(plan, inputs).astype(np.float32)  # the model's own plan (float16 outputs rounded)
        for tiles in TUNER_TILES:
            layout = retiled(plan, tiles)
            if layout is None:
                continue
            sliced += tiles.warps_k > 1
            got = run_plan(layout, inputs).astype(np.float32)
            _close(got, want, 2e-6 if dtype == "float32" else 1e-3)
    assert sliced >= 6


@pytest.mark.parametrize("precision, dtype", [("tf32", "float32"), ("fp16", "float16")])
def test_a_producer_warpgroup_copies_what_every_thread_copied(precision: str, dtype: str) -> None:
    # warp-specialised twins: the producer's 128 threads copy each stage, every element once
    twins = 0
    ops = [*all_ops(capsule(2, batch=3, channels=16, out=6, dtype=dtype)), masked_gradient(dtype)]
    for op in ops:
        inputs = {name: value.astype(dt.numpy_dtype(dtype)) for name, value in _exact_inputs(op, seed=7).items()}
        plan = plan_op(op, "k", precision)
        kernels = tuple(producer_twin(k) or k for k in plan.kernels)
        twins += sum(k.specialized for k in kernels)
        assert all(k.copy_threads == 128 and k.block_threads == k.tiles.threads + 128 for k in kernels if k.specialized)
        want = run_plan(plan, inputs).astype(np.float32)
        _close(run_plan(OpPlan(op, kernels, plan.zero_first), inputs).astype(np.float32), want, 0.0)
        source = mma_source(next(k for k in kernels if k.specialized))
        assert "the producer warpgroup" in source and "nf_bar_arrive" in source
    assert twins >= len(ops)


def test_a_sliced_depth_keeps_its_sums_apart_until_the_end() -> None:
    # one slice's accumulators dropped: the result must change (the model really sums the slices)
    op = capsule(1, batch=2, channels=16, out=5)
    inputs = _exact_inputs(op, seed=6)
    base = plan_op(op, "k", "tf32").kernels[0]
    kernel = make_kernel("k", base.view, next(t for t in TUNER_TILES if t.warps_k == 2), "tf32")
    assert kernel.tiles.warps_k == 2 and whole_copies(kernel)
    plan = OpPlan(op, (kernel,), False)
    _close(run_plan(plan, inputs), neoflow.evaluate(op, inputs))
    source = mma_source(kernel)
    assert "nf_warp_k" in source and "nf_sums" in source and "if (nf_warp_k > 0) return;" in source
    assert kernel.shared_bytes >= (kernel.tiles.warps_k - 1) * kernel.tiles.block_m * kernel.tiles.block_n * 4


@pytest.mark.parametrize("precision", ["fp16", "tf32"])
def test_either_order_of_a_warps_loads_computes_the_same(precision: str) -> None:
    from neoflow.targets.cuda.plan import copy_footprint

    # consecutive threads along a vector's direction or across it: both orders, both operands
    for op in all_ops(capsule(2)):
        inputs = _exact_inputs(op, seed=5)
        want = neoflow.evaluate(op, inputs)
        plan = plan_op(op, "k", precision)
        for a_across in (False, True):
            for b_across in (False, True):
                kernels = tuple(
                    dataclasses.replace(k, a_lanes_across=a_across, b_lanes_across=b_across) for k in plan.kernels
                )
                _close(run_plan(OpPlan(op, kernels, plan.zero_first), inputs), want)
        for kernel in plan.kernels:  # the plan took the order touching fewer sectors, then lines
            for side in ("a", "b"):
                other = dataclasses.replace(kernel, **{f"{side}_lanes_across": not kernel.lanes_across(side)})
                assert copy_footprint(kernel, side) <= copy_footprint(other, side)


def test_a_weight_read_along_its_depth_is_loaded_in_whole_lines() -> None:
    from neoflow.targets.cuda.plan import copy_footprint

    # the capsule conv's W[k, c, r, s, t, j]: vectors along j (rows), the depth (c, r, s, t)
    # contiguous behind them: a quarter warp's eight vectors of 16 bytes make one whole line
    (kernel,) = tensor_core_plan(capsule(1, channels=32), "k", "tf32").kernels
    assert kernel.rows_fastest("b") and kernel.lanes_across("b")
    assert copy_footprint(kernel, "b") == (4, 1)  # sectors, lines


def test_loads_are_ordered_by_what_a_quarter_warp_touches() -> None:
    from neoflow.targets.cuda.plan import copy_footprint

    # the stride-2 capsule conv's input In[b, c, 2p + r, 2q + s, i, t]: along the depth, a quarter
    # warp's eight vectors (t, over r and s) lie in eight sectors; across the rows (i, then q), four
    # vectors of each of two 64-byte runs fill four (a warp's 32 vectors touch 16 sectors either way)
    (kernel,) = tensor_core_plan(capsule(2, channels=32, out=14), "k", "tf32").kernels
    other = dataclasses.replace(kernel, a_lanes_across=not kernel.a_lanes_across)
    assert kernel.a_lanes_across
    assert copy_footprint(kernel, "a")[0] == 4 and copy_footprint(other, "a")[0] == 8


def test_padding_guards_bias_and_relu_epilogue() -> None:
    op = conv_relu()
    plan = plan_op(op, "k", "tf32")
    (kernel,) = plan.kernels
    assert isinstance(kernel, MmaKernel) and kernel.view.epilogue is not None
    inputs = _exact_inputs(op, seed=5)
    want = neoflow.evaluate(op, inputs)
    assert (want == 0).any() and (want > 0).any()  # the ReLU cuts some outputs
    _close(run_plan(plan, inputs), want)
    # split depth: partial sums in the float32 workspace, the epilogue in the finishing kernel
    split = OpPlan(op, (dataclasses.replace(kernel, splits=3),), plan.zero_first)
    assert split.workspace
    _close(run_plan(split, inputs), want)


def test_float16_tensors_use_the_tensor_cores_directly() -> None:
    op = neoflow.op(
        "C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (70, 40), "B": (40, 50)}, dtype="float16"
    )
    inputs = {k: v.astype(np.float16) for k, v in inputs_for(op, 2).items()}
    got = run_plan(plan_op(op, "k", "fp16"), inputs)
    assert got.dtype == np.float16
    want = inputs["A"].astype(np.float64) @ inputs["B"].astype(np.float64)
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()  # the output's own float16 rounding


def test_operands_are_rounded_to_the_precision() -> None:
    op = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (16, 16), "B": (16, 8)})
    a = np.full((16, 16), 1 + 2**-12, np.float32)  # exact in fp32, rounds to 1 in fp16, tf32 and bf16
    b = np.ones((16, 8), np.float32)
    for precision in PRECISIONS:
        got = run_plan(plan_op(op, "k", precision), {"A": a, "B": b})
        assert np.all(got == 16.0), precision
    assert np.allclose(run_plan(plan_op(op, "k", "fp32"), {"A": a, "B": b}), 16 * (1 + 2**-12))


def test_round_to_matches_the_hardware_conversions() -> None:
    x = np.array([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 1 + 2**-8, 1 + 2**-8 + 2**-12], np.float32)
    assert list(round_to(x, "float16")) == list(x.astype(np.float16).astype(np.float32))
    # tf32 (cvt.rn): 10 bits of mantissa, ties to even (1 + 2^-11 is a tie between 1 and 1 + 2^-10)
    assert list(round_to(x[:3], "tf32")) == [1.0, 1 + 2**-9, -1.0]
    # bf16: 7 bits, ties to even (1 + 2^-8 is a tie between 1 and 1 + 2^-7)
    assert round_to(x[3:4], "bfloat16")[0] == 1.0 and round_to(x[4:5], "bfloat16")[0] == 1 + 2**-7


def test_a_tile_element_no_thread_loads_poisons_the_result(monkeypatch) -> None:
    op = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (32, 32), "B": (32, 32)})
    plan = plan_op(op, "k", "fp16")
    kernel = dataclasses.replace(plan.kernels[0], a_vector=1, b_vector=1)
    original = MmaKernel.load_coords

    def skip_last_column(self, side):
        row, col, count = original(self, side)
        return row, col - col // (self.tiles.block_k - 1), count  # column 31 is never loaded

    monkeypatch.setattr(MmaKernel, "load_coords", skip_last_column)
    got = run_plan(OpPlan(op, (kernel,), False), inputs_for(op))
    assert np.isnan(got).all()


def test_vector_loads_are_planned_only_where_runs_are_aligned() -> None:
    aligned = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (64, 64), "B": (64, 64)})
    (kernel,) = plan_op(aligned, "k", "fp16").kernels
    assert (kernel.a_vector, kernel.b_vector) == (4, 4)  # 16 bytes of float32, along k for A and j for B
    _close(
        run_plan(plan_op(aligned, "k", "fp16"), _exact_inputs(aligned)),
        neoflow.evaluate(aligned, _exact_inputs(aligned)),
    )
    ragged = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (32, 31), "B": (31, 32)})
    (kernel,) = plan_op(ragged, "k", "fp16").kernels
    assert kernel.a_vector == 1  # rows of 31 floats: a run of 2 or 4 would start unaligned
    forced = dataclasses.replace(kernel, a_vector=4)
    with pytest.raises(AssertionError, match="not aligned"):
        run_plan(OpPlan(ragged, (forced,), False), inputs_for(ragged))


def test_a_transposed_convs_input_adjoint_runs_on_the_tensor_cores() -> None:
    # the adjoint of a stride-2 transposed conv sums over a residue its domain fixes to 0
    op = neoflow.op(
        "Y[n, k, l] = ReduceAdd({c, r}, Select((l - r) % 2 == 0 && (l - r) // 2 >= 0 && (l - r) // 2 < 6, "
        "X[n, c, (l - r) // 2], 0) * W[c, k, r])",
        shapes={"X": (2, 8, 6), "W": (8, 8, 4)},
        out_shape=(2, 8, 14),
    )
    adjoint = neoflow.grad(op)["X"]
    plan = plan_op(adjoint, "k", "fp16")
    assert all(isinstance(k, MmaKernel) for k in plan.kernels)
    inputs = _exact_inputs(adjoint, seed=7)
    _close(run_plan(plan, inputs), neoflow.evaluate(adjoint, inputs))


def test_a_transposed_conv_runs_as_dense_pieces_of_its_lattice() -> None:
    # the parity guard of a stride-2 transposed conv becomes the sum's domain: 4 dense products
    op = neoflow.op(
        "Y[n, k, h, w] = ReduceAdd({c, r, s}, Select((h - r) % 2 == 0 && (w - s) % 2 == 0 && (h - r) // 2 >= 0 && "
        "(h - r) // 2 < 5 && (w - s) // 2 >= 0 && (w - s) // 2 < 5, X[n, c, (h - r) // 2, (w - s) // 2], 0) * "
        "K[c, k, r, s])",
        shapes={"X": (2, 8, 5, 5), "K": (8, 8, 4, 4)},
        out_shape=(2, 8, 12, 12),
    )
    for each in all_ops(op):
        plan = tensor_core_plan(each, "k", "tf32")  # the input adjoint's few sums run a block each
        assert all(isinstance(k, MmaKernel) and k.a_gather and k.b_gather for k in plan.kernels), each.name
        inputs = _exact_inputs(each, seed=11)
        _close(run_plan(plan, inputs), neoflow.evaluate(each, inputs))
    assert len(plan_op(op, "k", "tf32").kernels) == 4


@pytest.mark.parametrize("precision", ["fp16", "tf32"])
def test_a_gradient_masked_by_its_relu_is_one_operand(precision: str) -> None:
    from tests.targets.cuda.gpu_cases import masked_gradient

    # G * [A > 0] reads two tensors at the same point: one operand of the matrix product,
    # gathered through one pair of index tables, both tensors in vectors
    op = masked_gradient()
    plan = plan_op(op, "k", precision)
    (kernel,) = plan.kernels
    assert isinstance(kernel, MmaKernel)
    (side,) = [side for side in ("a", "b") if kernel.gather(side).tensors == ("G", "A")]
    assert kernel.vector(side) == 4
    inputs = _exact_inputs(op, seed=13)
    _close(run_plan(plan, inputs), neoflow.evaluate(op, inputs))


@pytest.mark.parametrize("case", ["masked_gradient", "masked_input_gradient"])
@pytest.mark.parametrize(("dtype", "precision"), [("float32", "tf32"), ("float16", "fp16")])
def test_a_masked_operand_is_copied_tensor_by_tensor_and_combined_as_it_is_read(
    case: str, dtype: str, precision: str
) -> None:
    from tests.targets.cuda import gpu_cases

    # G * [A > 0] in a kernel copying by cp.async: a tile of G and one of A, the mask applied to the
    # fragments read back (rows along memory: a depth-major tile; depth along memory: a row-major one)
    op = getattr(gpu_cases, case)(dtype)
    (kernel,) = plan_op(op, "k", precision).kernels
    assert isinstance(kernel, MmaKernel) and kernel.direct
    (side,) = [side for side in ("a", "b") if kernel.gather(side).tensors == ("G", "A")]
    assert kernel.combined(side) and kernel.copies(side) == 2
    assert kernel.stage_elements(side) == 2 * kernel.tile_elements(side)
    assert f"nf_combine_{side}(" in mma_source(kernel)
    inputs = {name: value.astype(dt.numpy_dtype(dtype)) for name, value in _exact_inputs(op, seed=5).items()}
    want = neoflow.evaluate(op, {name: value.astype(np.float32) for name, value in inputs.items()})
    tolerance = 2e-6 if dtype == "float32" else 1e-3  # float16 outputs: their own rounding
    for tiles in TILE_CHOICES:  # every tile, a split depth, each loads the tiles its own way
        for splits in (1, 3):
            each = dataclasses.replace(make_kernel("k", kernel.view, tiles, precision), splits=splits)
            assert each.combined(side), tiles
            got = run_plan(OpPlan(op, (each,), splits > 1), inputs).astype(np.float32)
            _close(got, want, tolerance)


def test_a_split_kernel_adds_neighbouring_sums_as_one_pair() -> None:
    # a split depth's partial sums go into a float32 workspace laid out as the output: an even column and
    # its neighbour lie together there, and leave as one float2 atomic addition (Hopper)
    even = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (40, 512), "B": (512, 24)})
    odd = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (40, 512), "B": (512, 23)})
    for op, paired in ((even, True), (odd, False)):
        (view,) = gemm_views(op, TENSOR_CORE)
        kernel = dataclasses.replace(make_kernel("k", view, TILE_CHOICES[2], "tf32"), splits=4)
        assert kernel.paired_stores is paired
        assert ("reinterpret_cast<float2 *>(nf_sum)" in mma_source(kernel)) is paired
        inputs = _exact_inputs(op, seed=7)
        _close(run_plan(OpPlan(op, (kernel,), True), inputs), neoflow.evaluate(op, inputs))


def test_a_combined_operand_is_zero_where_nothing_is_copied() -> None:
    from neoflow.targets.cuda.plan import pointwise_gather

    # past a tensor's rows or depth a copy fills zeros: only an operand that is zero there may be combined
    masked = neoflow.op("Y[i, j] = ReduceAdd({k}, G[i, k] * Select(A[i, k] > 0, 1, 0) * W[k, j])", shapes=SHAPES)
    shifted = neoflow.op("Y[i, j] = ReduceAdd({k}, (G[i, k] + exp(A[i, k])) * W[k, j])", shapes=SHAPES)
    for op, expected in ((masked, True), (shifted, False)):
        kernel = plan_op(op, "k", "tf32").kernels[0]
        assert pointwise_gather(kernel.gather("a"), op) is expected
        assert kernel.combined("a") is expected


def test_long_sums_with_few_outputs_reduce_a_block_per_point() -> None:
    from neoflow.targets.cuda.plan import SimtKernel
    from tests.targets.cuda.gpu_cases import long_sums

    (kernel,) = plan_op(long_sums(), "k", "tf32").kernels
    assert isinstance(kernel, SimtKernel) and kernel.block_reduce and kernel.grid == (48, 1, 1)
    short = neoflow.op("Y[i] = ReduceAdd({k}, A[i, k])", shapes={"A": (4096, 16)})
    assert not plan_op(short, "k", "tf32").kernels[0].block_reduce
    # a mean loss: one point, 64 terms each summing 10 more (one thread took 28 us on an H100)
    loss = neoflow.op(
        "L[] = ReduceAdd({n}, log(S[n]) - ReduceAdd({c}, Select(c == y[n], Z[n, c], 0))) / 64",
        shapes={"S": (64,), "Z": (64, 10), "y": (64,)},
        dtypes={"y": "int64"},
    )
    (kernel,) = plan_op(loss, "k", "tf32").kernels
    assert isinstance(kernel, SimtKernel) and kernel.block_reduce
    rows = neoflow.op("Y[i] = ReduceAdd({k}, A[i, k])", shapes={"A": (64, 10)})  # a few terms: a thread each
    assert not plan_op(rows, "k", "tf32").kernels[0].block_reduce


def test_a_sum_over_a_lattice_steps_through_it() -> None:
    from neoflow.targets.cuda.emit import kernel_source
    from neoflow.targets.cuda.plan import SimtKernel

    # as a reshape's adjoint does: of 576 terms only those with e = 4 i (mod 48) count
    op = neoflow.op(
        "Y[i] = ReduceAdd({e: 576 | (e - 4 * i) % 48 == 0}, A[e] * 2)", shapes={"A": (576,)}, out_shape=(12,)
    )
    (kernel,) = plan_op(op, "k", "tf32").kernels
    assert isinstance(kernel, SimtKernel) and not kernel.block_reduce
    source = kernel_source(kernel)
    assert "v_e = nf_mod(" in source and "v_e += 48" in source  # from its residue, in steps of 48


@pytest.mark.parametrize("name", sorted(WGMMA_PRODUCTS))
@pytest.mark.parametrize("tiles", WGMMA_TILES, ids=lambda t: f"n{t.block_n}")
def test_wgmma_kernels_read_through_their_descriptors_what_the_copies_stored(name: str, tiles) -> None:
    # float16 outputs: the fp32 sums, in another order than the interpreter's, may round one unit apart
    for splits in (1, 3):
        plan = wgmma_plan(name, tiles, splits)
        inputs = _exact_inputs(plan.op)
        got, want = run_plan(plan, inputs).astype(np.float32), neoflow.evaluate(plan.op, inputs).astype(np.float32)
        _close(got, want, tolerance=2.0**-10)


def test_a_wrong_wgmma_descriptor_is_caught() -> None:
    # MN-major tiles with the leading and stride byte offsets exchanged (the layout the GPU refuted):
    # the operand the multiplies read is no longer the one the copies stored
    (kernel,) = wgmma_plan("tn", WGMMA_TILES[1]).kernels
    swapped = type(kernel).descriptor

    def exchanged(self, side, warpgroup, step):
        start, leading, stride = swapped(self, side, warpgroup, step)
        return (start, stride, leading) if self.layout(side) == "depth" else (start, leading, stride)

    for name in ("tn", "nn"):  # past the stage, or a wrong element of it
        plan = wgmma_plan(name, WGMMA_TILES[0])
        inputs = _exact_inputs(plan.op)
        want = neoflow.evaluate(plan.op, inputs).astype(np.float32)
        try:
            type(kernel).descriptor = exchanged
            got = run_plan(plan, inputs).astype(np.float32)
        except ValueError as err:
            assert "reads past its stage" in str(err)
            continue
        finally:
            type(kernel).descriptor = swapped
        assert np.isnan(got).any() or np.abs(got - want).max() > 1e-2 * np.abs(want).max()


def test_the_swizzle_keeps_a_copy_vector_together_and_spreads_lines_over_the_banks() -> None:
    elements = np.arange(8 * 64)  # eight 128-byte lines of 16-bit elements
    placed = swizzle128(elements)
    assert sorted(placed) == list(elements)  # a permutation of the atom
    vectors = placed.reshape(8, 8, 8)  # [line][16-byte chunk][element]
    assert (np.diff(vectors, axis=-1) == 1).all()  # a chunk's 8 elements stay together
    first_chunks = vectors[:, 0, 0] * 2 // 16 % 8  # the bank group chunk 0 of each line lands in
    assert sorted(first_chunks) == list(range(8))


@pytest.mark.parametrize("across", [True, False])
def test_tf32_tiles_read_element_by_element_take_copies_and_reads_without_bank_conflicts(across: bool) -> None:
    from neoflow.targets.cuda.plan import LANE, REG, tf32_a_coords, tf32_b_coords

    op = neoflow.grad(capsule(2, channels=16))["W"]  # both operands loaded row-fastest: the depth layout
    (kernel,) = plan_op(op, "k", "tf32").kernels
    kernel = dataclasses.replace(kernel, a_lanes_across=across, b_lanes_across=across)
    lanes = np.arange(32)
    for side, coords in (("a", tf32_a_coords()), ("b", tf32_b_coords())):
        assert kernel.layout(side) == "depth" and not kernel.by_ldmatrix(side)
        rows, depth = kernel.tile_rows(side), kernel.tiles.block_k
        grid = np.meshgrid(np.arange(rows), np.arange(depth), indexing="ij")
        places = kernel.smem_index(side, *grid)
        assert len(np.unique(places)) == rows * depth and places.max() < kernel.tile_elements(side)
        row_f, col_f, count = kernel.load_coords(side)
        for element in range(count):  # each quarter warp's 16-byte copies: eight bank groups
            threads = np.arange(kernel.copy_threads)
            env = {"tid": threads, "element": np.full_like(threads, element), "vec": np.zeros_like(threads)}
            row, col = (np.broadcast_to(index.evaluate(f, env), threads.shape) for f in (row_f, col_f))
            groups = kernel.smem_index(side, row, col) // 4 % 8
            assert all(len(set(quarter)) == 8 for quarter in groups.reshape(-1, 8)), (side, element)
        for kk in range(0, depth, 8):  # the warp's element reads of each fragment register: 32 banks
            for register in range(4 if side == "a" else 2):
                line, at = (np.asarray(sympy.lambdify(LANE, c.subs(REG, register))(lanes)) for c in coords)
                banks = kernel.smem_index(side, np.broadcast_to(line, lanes.shape), kk + at) % 32
                assert len(set(banks)) == 32, (side, kk, register)


def test_hopper_plans_put_large_16_bit_products_on_wgmma() -> None:
    def product(dtype: str):
        shapes = {"A": (2048, 2048), "B": (2048, 2048)}
        return neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes=shapes, dtype=dtype)

    (hopper,) = plan_op(product("float16"), "k", "fp16", "sm_90").kernels
    (ampere,) = plan_op(product("float16"), "k", "fp16", "sm_80").kernels
    (tf32,) = plan_op(product("float32"), "k", "tf32", "sm_90").kernels
    assert hopper.wgmma and hopper.block_threads == hopper.tiles.threads + 128
    assert not ampere.wgmma and not tf32.wgmma  # Hopper only; here 16-bit operands only


@pytest.mark.parametrize("wgmma", [True, False], ids=["wgmma", "mma.sync"])
def test_outputs_go_out_in_pairs_only_where_neighbouring_columns_lie_together(wgmma: bool) -> None:
    tiles = WGMMA_TILES[0] if wgmma else TILE_CHOICES[0]
    assert wgmma_plan("nn", WGMMA_TILES[0]).kernels[0].paired_stores
    split = wgmma_plan("nn", WGMMA_TILES[0], splits=2).kernels[0]  # sums added into a workspace, two at once
    assert split.paired_stores and "reinterpret_cast<float2 *>(nf_sum)" in mma_source(split)

    def kernel(out: str, columns: int, dtype: str = "float16") -> MmaKernel:
        shapes = {"A": (64, 64), "B": (64, columns)}
        op = neoflow.op(f"{out} = ReduceAdd({{k}}, A[i, k] * B[k, j])", shapes=shapes, dtype=dtype)
        (view,) = gemm_views(op, TENSOR_CORE)
        precision = "fp16" if dtype == "float16" else "tf32"  # tf32: mma.sync only
        return dataclasses.replace(make_kernel("k", view, tiles, precision), wgmma=wgmma and precision == "fp16")

    assert kernel("C[i, j]", 72).paired_stores
    assert kernel("C[i, j]", 72, "float32").paired_stores  # a float2
    assert not kernel("C[i, j]", 71).paired_stores  # an odd row: every other pair would straddle two rows
    assert not kernel("C[j, i]", 72).paired_stores  # neighbouring columns a row apart
    source = mma_source(kernel("C[i, j]", 72, "float32"))
    assert "*reinterpret_cast<float2 *>(&nf_out[nf_roff + nf_coff[fn][nf_o]])" in source


def test_the_epilogue_adds_a_row_part_and_a_column_part_of_the_output_offset() -> None:
    for op in all_ops(capsule(2)):
        for kernel in plan_op(op, "k", "fp16").kernels:
            view, parts = kernel.view, kernel.output_parts
            assert parts is not None, f"{kernel.name}: a capsule piece's offset splits into rows and columns"
            rows = {index.var(v) for v, _ in view.m}
            assert parts.row.free_symbols <= rows and not parts.col.free_symbols & rows
            assert sympy.expand(parts.row + parts.col + parts.rest - view.out_offset) == 0
            assert "nf_roff + nf_coff[fn][nf_o]" in mma_source(kernel)
    (view,) = gemm_views(
        neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (8, 8), "B": (8, 8)}), TENSOR_CORE
    )
    mixed = dataclasses.replace(view, out_offset=index.var("i") * index.var("j"))
    assert output_parts(mixed) is None  # a term of both: the epilogue computes each element's whole offset


def test_a_depth_of_whole_tiles_is_not_tested_against_its_end() -> None:
    def source(depth: int) -> str:
        shapes = {"A": (64, depth), "B": (depth, 64)}
        op = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes=shapes, dtype="float16")
        (view,) = gemm_views(op, TENSOR_CORE)
        return mma_source(make_kernel("k", view, TILE_CHOICES[2], "fp16"))

    assert "nf_k_ok = true" in source(64) and "nf_k0 + nf_col <" not in source(64)
    assert "nf_k0 + nf_col < 72" in source(72)
