"""The reference interpreter against plain numpy."""

import ml_dtypes
import numpy as np
import pytest

import neoflow
from neoflow.errors import ShapeError
from neoflow.ir import interpreter


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize(
    ("kind", "combine"),
    [
        ("ReduceMax", np.max),
        ("ReduceMin", np.min),
        ("ReduceAdd", np.sum),
        ("ReduceMul", np.prod),
    ],
)
def test_pooling_reductions(kind: str, combine) -> None:
    x = rand(2, 3, 6, 8)
    op = neoflow.op(
        f"Y[n, c, p, q] = {kind}({{r: 2, s: 2}}, X[n, c, p*2+r, q*2+s])", shapes={"X": x.shape}, dtype="float64"
    )
    assert op.shape == (2, 3, 3, 4)
    expected = combine(x.reshape(2, 3, 3, 2, 4, 2), axis=(3, 5))
    np.testing.assert_allclose(neoflow.evaluate(op, {"X": x}), expected, rtol=1e-12)


def test_overlapping_max_pool() -> None:
    x = rand(1, 1, 7, 7)
    op = neoflow.op("Y[n, c, p, q] = ReduceMax({r: 3, s: 3}, X[n, c, p*2+r, q*2+s])", shapes={"X": x.shape})
    windows = np.lib.stride_tricks.sliding_window_view(x, (3, 3), axis=(2, 3))[:, :, ::2, ::2]
    np.testing.assert_allclose(neoflow.evaluate(op, {"X": x}), windows.max(axis=(4, 5)), rtol=1e-6)


def test_nested_reduction_softmax() -> None:
    x = rand(4, 5)
    op = neoflow.op(
        "Y[i, j] = exp(X[i, j] - ReduceMax({m}, X[i, m])) / ReduceAdd({k}, exp(X[i, k] - ReduceMax({l}, X[i, l])))",
        shapes={"X": x.shape},
        dtype="float64",
    )
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(neoflow.evaluate(op, {"X": x}), e / e.sum(axis=1, keepdims=True), rtol=1e-12)


def test_accumulate_form_sums_free_variables() -> None:
    x, w = rand(3, 4), rand(4, 5)
    op = neoflow.op("Y[i, j] += X[i, k] * W[k, j]", shapes={"X": x.shape, "W": w.shape}, dtype="float64")
    np.testing.assert_allclose(neoflow.evaluate(op, {"X": x, "W": w}), x @ w, rtol=1e-12)


def test_index_values_and_floor_division() -> None:
    x = rand(5)
    op = neoflow.op("Y[i, j] = X[i] * j + 0.5 - (i + 1)/2", shapes={"X": x.shape, "Y": (5, 3)}, dtype="float64")
    i, j = np.arange(5)[:, None], np.arange(3)[None, :]
    np.testing.assert_allclose(neoflow.evaluate(op, {"X": x}), x[:, None] * j + 0.5 - (i + 1) // 2)


def test_negative_floor_division_and_modulo_follow_python() -> None:
    op = neoflow.op("Y[i] = X[(i - 3)//2 + 2] * 10 + (i - 3)%4", shapes={"X": (4,), "Y": (7,)}, dtype="float64")
    x = np.arange(4.0)
    expected = [x[(i - 3) // 2 + 2] * 10 + (i - 3) % 4 for i in range(7)]
    np.testing.assert_array_equal(neoflow.evaluate(op, {"X": x}), expected)


def test_short_circuit_guards_a_read() -> None:
    x = rand(6)
    op = neoflow.op(
        "Y[i] = Select(i > 0 && X[i - 1] > 0, 1.0, 0.0) + Select(i == 5 || X[i + 1] < 0, 2, 0)", shapes={"X": x.shape}
    )
    prev = np.concatenate([[0], x[:-1]])
    nxt = np.concatenate([x[1:], [0]])
    expected = ((np.arange(6) > 0) & (prev > 0)) * 1.0 + ((np.arange(6) == 5) | (nxt < 0)) * 2.0
    np.testing.assert_array_equal(neoflow.evaluate(op, {"X": x}), expected)


def test_data_dependent_gather() -> None:
    x, idx = rand(6), np.array([5, 0, 3, 3])
    op = neoflow.op("Y[i] = X[idx[i]]", shapes={"X": x.shape, "idx": idx.shape}, dtypes={"idx": "int64"})
    np.testing.assert_array_equal(neoflow.evaluate(op, {"X": x, "idx": idx}), x[idx].astype(np.float32))
    with pytest.raises(ShapeError, match=r"read X\[idx\[i\]\] is out of bounds"):
        neoflow.evaluate(op, {"X": x, "idx": np.array([0, 6, 1, 1])})


def test_dtypes() -> None:
    x = rand(4).astype(np.float16)
    half = neoflow.op("Y[i] = X[i] * 2 + 1.5", shapes={"X": (4,)}, dtype="float16")
    out = neoflow.evaluate(half, {"X": x})
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, x * np.float16(2) + np.float16(1.5))
    mask = neoflow.op("M[i] = X[i] > 0", shapes={"X": (4,)})
    assert mask.dtype == "bool" and neoflow.evaluate(mask, {"X": x}).dtype == np.bool_
    ints = neoflow.op("K[i] = int32(X[i] * 10) // 3 + i", shapes={"X": (4,)})
    assert ints.dtype == "int32"
    np.testing.assert_array_equal(
        neoflow.evaluate(ints, {"X": x}), (x.astype(np.float32) * 10).astype(np.int32) // 3 + np.arange(4)
    )
    wide = neoflow.op("Y[i] = X[i] / 3", shapes={"X": (4,)}, dtype="float64")
    np.testing.assert_array_equal(neoflow.evaluate(wide, {"X": x}), x.astype(np.float64) / 3)


def test_storage_floats_meet_each_other_and_float16() -> None:
    # bfloat16 tensors multiplied (a product of storage-only floats was a KeyError); bfloat16 with
    # float16: neither holds the other, so float32
    both = neoflow.op("Y[i] = A[i] * B[i]", shapes={"A": (4,), "B": (4,)}, dtype="bfloat16")
    assert both.dtype == "bfloat16"
    a, b = (rand(4, seed=s).astype(ml_dtypes.bfloat16) for s in (0, 1))
    want = (a.astype(np.float32) * b.astype(np.float32)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(neoflow.evaluate(both, {"A": a, "B": b}), want)
    mixed = neoflow.op("Y[i] = A[i] * B[i]", shapes={"A": (4,), "B": (4,)}, dtypes={"A": "bfloat16", "B": "float16"})
    assert mixed.dtype == "float32"


def test_unary_and_binary_functions() -> None:
    x, z = rand(7), rand(7, seed=1)
    op = neoflow.op(
        "Y[i] = exp(X[i]) + log(abs(X[i])) + sqrt(abs(Z[i])) + tanh(X[i]) + sigmoid(Z[i]) "
        "+ pow(abs(X[i]), Z[i]) + max(X[i], Z[i]) * min(X[i], Z[i]) - -X[i]",
        shapes={"X": x.shape, "Z": z.shape},
        dtype="float64",
    )
    expected = (
        np.exp(x)
        + np.log(np.abs(x))
        + np.sqrt(np.abs(z))
        + np.tanh(x)
        + 1 / (1 + np.exp(-z))
        + np.abs(x) ** z
        + np.maximum(x, z) * np.minimum(x, z)
        + x
    )
    np.testing.assert_allclose(neoflow.evaluate(op, {"X": x, "Z": z}), expected, rtol=1e-12)


def test_chunked_evaluation_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = rand(2, 3, 9, 9, 2, 2), rand(4, 3, 3, 3, 2, 2, seed=1)
    op = neoflow.op(
        "C[b, k, p, q, i, j] = ReduceAdd({c, r, s, t}, A[b, c, p*2+r, q*2+s, i, t] * B[k, c, r, s, t, j])",
        shapes={"A": a.shape, "B": b.shape},
        dtype="float64",
    )
    whole = neoflow.evaluate(op, {"A": a, "B": b})
    monkeypatch.setattr(interpreter, "CHUNK_POINTS", 200)
    chunks = list(interpreter._chunks(op.shape, 3 * 3 * 3 * 2))
    assert len(chunks) > 10
    np.testing.assert_allclose(neoflow.evaluate(op, {"A": a, "B": b}), whole, rtol=1e-12)


def test_a_read_the_same_over_chunks_is_gathered_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # a convolution's input window does not move with the output channel: chunked over channels,
    # the window is gathered once and every chunk reads it; the weights, read per channel, again
    x, w = rand(1, 3, 10, 10), rand(6, 3, 3, 3, seed=1)
    op = neoflow.op(
        "Y[n, k, p, q] = ReduceAdd({c, r, s}, X[n, c, p + r, q + s] * W[k, c, r, s])",
        shapes={"X": x.shape, "W": w.shape},
        dtype="float64",
    )
    whole = neoflow.evaluate(op, {"X": x, "W": w})
    monkeypatch.setattr(interpreter, "CHUNK_POINTS", 8 * 8 * 27)  # one output channel a chunk
    gathered: list[str] = []
    real = interpreter._OpEvaluator.gather

    def counted(self, tensor, indices, live, node):
        gathered.append(tensor)
        return real(self, tensor, indices, live, node)

    monkeypatch.setattr(interpreter._OpEvaluator, "gather", counted)
    np.testing.assert_allclose(neoflow.evaluate(op, {"X": x, "W": w}), whole, rtol=1e-12)
    assert gathered.count("X") == 1 and gathered.count("W") == 6


def test_a_read_reused_over_chunks_is_still_checked_where_it_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    # X[idx[i]] leaves X at i == 2; only the chunk of k == 3 uses it there, after chunks that reuse it unused
    op = neoflow.op(
        "Y[k, i] = Select(k == 3, X[idx[i]], 0.0) + T[k]",
        shapes={"X": (8,), "idx": (4,), "T": (4,)},
        dtypes={"idx": "int64"},
    )
    monkeypatch.setattr(interpreter, "CHUNK_POINTS", 4)  # one k a chunk
    inputs = {"X": np.ones(8, np.float32), "idx": np.array([0, 1, 9, 2]), "T": np.zeros(4, np.float32)}
    with pytest.raises(ShapeError, match="out of bounds where its value is used"):
        neoflow.evaluate(op, inputs)
    inputs["idx"][2] = 7
    np.testing.assert_array_equal(neoflow.evaluate(op, inputs), [[0] * 4] * 3 + [[1] * 4])


def test_chunks_cover_the_output_exactly() -> None:
    covered = np.zeros((3, 5, 7), int)
    for chunk in interpreter._chunks((3, 5, 7), 1_000_000):
        covered[chunk] += 1
    assert (covered == 1).all()


def test_graph_keeps_intermediates_on_request() -> None:
    graph = neoflow.graph("H[i] = X[i] * 2\nY[i] = H[i] + 1", shapes={"X": (3,)})
    values = interpreter.evaluate_graph(graph, {"X": np.ones(3)}, keep=True)
    assert set(values) == {"X", "H", "Y"}
    np.testing.assert_array_equal(values["Y"], [3, 3, 3])
