"""Measured tuning: every choice the tuner may take computes the interpreter's result, the search keeps
only what matches and is faster, the table is used by later compiles, survives damage and can be ignored."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import neoflow
from neoflow.ir.interpreter import evaluate_op
from neoflow.ir.op import positional_variables
from neoflow.runtime.compiled import _cache_key
from neoflow.targets.cache import write_atomically
from neoflow.targets.cpu import tuning
from neoflow.targets.cpu.executor import CpuExecutor, threads
from neoflow.targets.cpu.gemm import STRUCTURES, Blocking
from neoflow.targets.cpu.lower import KernelChoice, lower_op, lowering_paths
from tests.on_targets import NEEDS_CC

MODELS = Path(__file__).resolve().parents[3] / "models"

pytestmark = NEEDS_CC

OPS = {
    "gemm": ("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j]) + Bias[j]", {"A": (67, 300), "B": (300, 37), "Bias": (37,)}),
    "conv": (
        "Y[n, k, p, q] = ReduceAdd({c, r, s}, Select(p + r - 1 >= 0 && p + r - 1 < 9 && q + s - 1 >= 0 && "
        "q + s - 1 < 9, X[n, c, p + r - 1, q + s - 1], 0) * W[k, c, r, s])",
        {"X": (2, 16, 9, 9), "W": (32, 16, 3, 3), "Y": (2, 32, 9, 9)},
    ),
    "weight_gradient": (
        "dW[k, c, r, s] = ReduceAdd({n, p, q}, dY[n, k, p, q] * X[n, c, p + r, q + s])",
        {"dY": (4, 20, 30, 30), "X": (4, 3, 32, 32)},
    ),
    "strided_adjoint": (
        "dX[c, z] = ReduceAdd({k, r | (z - r) % 2 == 0 && (z - r) // 2 >= 0 && (z - r) // 2 < 200}, "
        "dY[k, (z - r) // 2] * W[k, c, r])",
        {"dY": (16, 200), "W": (16, 16, 3), "Y": (16, 401)},
    ),
}


def _op(name: str):
    text, shapes = OPS[name]
    shapes = dict(shapes)
    out = shapes.pop("Y", None)
    return neoflow.op(text, shapes=shapes, out_shape=out)


def _inputs(op, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(t.shape).astype(np.float32) for t in op.inputs]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache directory of the test's own (kernels and tuning table), tuning on."""
    monkeypatch.setenv("NEOFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("NEOFLOW_TUNING", raising=False)
    return tmp_path


def _choices(op) -> list[KernelChoice]:
    found = [KernelChoice(path) for path in lowering_paths(op)]
    if "blocked" in lowering_paths(op):
        for structure in STRUCTURES:
            for kc, mc in ((256, 96), (512, 192), (60, 6)):
                found.append(KernelChoice("blocked", Blocking(kc=kc, mc=mc, structure=structure)))
    return found


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_choice_the_tuner_may_take_computes_the_interpreters_result(name: str) -> None:
    op = _op(name)
    inputs = _inputs(op)
    expected = evaluate_op(op, {t.name: a for t, a in zip(op.inputs, inputs, strict=True)})
    codes = set()
    for choice in _choices(op):
        code = lower_op(op, "KERNEL", choice)
        codes.add(code)
        found = tuning._Candidate(op, choice, code, inputs)()
        np.testing.assert_allclose(found, expected, rtol=2e-4, atol=2e-4 * np.abs(expected).max(), err_msg=str(choice))
    # the choices are really different kernels (a blocking the code ignored would hide here)
    assert len(codes) >= (6 if "blocked" in lowering_paths(op) else 2)


def test_bad_blockings_are_refused() -> None:
    with pytest.raises(ValueError, match="mc 50"):
        Blocking(mc=50)
    with pytest.raises(ValueError, match="no blocked-kernel structure 'wide'"):
        Blocking(structure="wide")


def test_tuning_keeps_the_default_unless_a_choice_is_faster_and_records_it(cache) -> None:
    op = _op("gemm")
    result = tuning.tune_op(op, _inputs(op))
    assert result.tried >= 5 and not result.rejected
    assert result.seconds <= result.default_seconds
    assert result.choice == KernelChoice() or result.seconds < tuning.MARGIN * result.default_seconds
    path = tuning.record([result], threads())
    entry = json.loads(path.read_text())[result.key]
    assert entry["op"] == op.name and entry["path"] == result.choice.path
    default = lower_op(op, "KERNEL")
    expected = None if result.choice == KernelChoice() else result.choice
    assert tuning.tuned_choice(default, threads()) == expected


def test_a_candidate_with_another_result_is_rejected_not_taken(cache, monkeypatch) -> None:
    op = _op("gemm")
    wrong = neoflow.op(
        "C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j]) - Bias[j]", shapes={"A": (67, 300), "B": (300, 37), "Bias": (37,)}
    )
    real = tuning.lower_op

    def lowered(target, name, choice=None):
        if choice is not None and choice.path == "nest":
            return real(wrong, name, choice)  # a nest computing something else
        return real(target, name, choice)

    monkeypatch.setattr(tuning, "lower_op", lowered)
    result = tuning.tune_op(op, _inputs(op))
    assert result.rejected == ("nest",)
    assert result.choice.path != "nest"


def _record(op, choice: KernelChoice) -> None:
    key = tuning.kernel_key(lower_op(positional_variables(op), "KERNEL"))  # as compiles lower it
    entry = {"path": choice.path, "structure": choice.blocking.structure, "kc": choice.blocking.kc}
    write_atomically(tuning.table_path(threads()), json.dumps({key: entry}).encode())


def test_compiles_take_the_tables_choice_and_still_compute_the_op(cache, monkeypatch) -> None:
    op = _op("conv")
    _record(op, KernelChoice("nest"))
    nest = lower_op(positional_variables(op), "KERNEL", KernelChoice("nest")).replace("KERNEL", "nf_kernel0")
    compiled = neoflow.compile(op, target="cpu")
    inputs = dict(zip([t.name for t in op.inputs], _inputs(op), strict=True))
    np.testing.assert_allclose(compiled.run(inputs), evaluate_op(op, inputs), rtol=2e-4, atol=1e-3)
    assert nest in compiled._forward.source
    monkeypatch.setenv("NEOFLOW_TUNING", "0")  # the table ignored: the default kernel again
    assert nest not in neoflow.compile(op, target="cpu")._forward.source


def test_a_damaged_table_is_ignored(cache) -> None:
    path = tuning.table_path(threads())
    path.parent.mkdir(parents=True)
    path.write_text('{"truncated": ')
    op = _op("gemm")
    assert tuning.load_table(threads()) == {}
    assert tuning.tuned_choice(lower_op(op, "KERNEL"), threads()) is None
    path.write_text(json.dumps({tuning.kernel_key(lower_op(op, "KERNEL")): {"path": "blocked", "mc": "x"}}))
    assert tuning.tuned_choice(lower_op(op, "KERNEL"), threads()) is None  # unreadable entry: the default


def test_the_compile_cache_key_follows_the_table(cache, monkeypatch) -> None:
    monkeypatch.setenv("NEOFLOW_COMPILE_CACHE", "1")
    path = tuning.table_path(threads())
    args = (str(MODELS / "four_op.nf"), "cpu", None, None, None, "none", None)
    first = _cache_key(*args)
    _record(_op("gemm"), KernelChoice("nest"))
    second = _cache_key(*args)
    monkeypatch.setenv("NEOFLOW_TUNING", "0")
    third = _cache_key(*args)
    assert len({first, second, third}) == 3 and path.is_file()


def test_executors_list_the_ops_that_run_alone(cache) -> None:
    op = _op("gemm")
    executor = neoflow.compile(op, target="cpu")._forward
    assert isinstance(executor, CpuExecutor)
    assert [o.name for o in executor.own_kernels()] == [op.name]
