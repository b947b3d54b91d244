"""A CI-sized share of the fuzzer (``python -m tests.fuzz`` runs the long one): mutated ONNX models and
text-language programs end in a result or a one-line ``NeoflowError``, never an internal error or a hang."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import fuzz
from tests.on_targets import NEEDS_CC

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(
    seed_model=st.sampled_from(fuzz.SEEDS),
    mutation=st.sampled_from(sorted(fuzz.MUTATIONS)),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_mutated_model_is_a_result_or_a_one_line_neoflow_error(seed_model, mutation, seed, tmp_path) -> None:
    data = fuzz.mutant(seed_model, mutation, seed)
    kind, detail = fuzz.outcome_within(data, tmp_path, seconds=30)
    assert kind in ("ok", "neoflow error"), f"{seed_model} {mutation} seed {seed}: {kind}: {detail}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed_model=st.sampled_from(fuzz.SEEDS),
    mutation=st.sampled_from(sorted(fuzz.MUTATIONS)),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_mutated_model_trained_a_step_is_a_result_or_a_one_line_neoflow_error(
    seed_model, mutation, seed, tmp_path
) -> None:
    data = fuzz.mutant(seed_model, mutation, seed)
    kind, detail = fuzz.outcome_within(data, tmp_path, seconds=30, train=True)
    assert kind in ("ok", "neoflow error"), f"{seed_model} {mutation} (train) seed {seed}: {kind}: {detail}"


@SETTINGS
@given(program=st.integers(0, len(fuzz.PROGRAMS) - 1), seed=st.integers(0, 2**31 - 1))
def test_a_mutated_program_is_a_result_or_a_one_line_neoflow_error(program, seed) -> None:
    kind, detail = fuzz.text_outcome(fuzz.text_mutant(program, seed))
    assert kind in ("ok", "neoflow error"), f"program {program} seed {seed}: {kind}: {detail}"


@pytest.mark.parametrize(
    ("mutation", "message"),
    [
        ("initializer_type", "which is no ONNX data type"),
        ("initializer_dims", "does not match its data type"),
    ],
)
def test_the_first_escapes_found_are_neoflow_errors_now(mutation, message, tmp_path) -> None:
    # cnn.onnx's escapes as the fuzzer first found them (a KeyError, a numpy reshape error)
    seeds = {"initializer_type": 1529936020, "initializer_dims": 1608848942}
    kind, detail = fuzz.outcome(fuzz.mutant("cnn.onnx", mutation, seeds[mutation]), tmp_path)
    assert kind == "neoflow error" and message in detail, detail


@NEEDS_CC
def test_a_batch_of_zero_compiles_for_cpu_and_refuses_to_train(tmp_path) -> None:
    # the cpu target's escape the long run found: an op over an empty domain split into no lattice pieces
    # (IndexError); trained, the loss averaged over nothing (a sympy complex infinity in its adjoint)
    data = fuzz.mutant("mlp.onnx", "input_dims", 1677345005)  # x: [0, 64]
    assert fuzz.outcome(data, tmp_path, target="cpu") == ("ok", "")
    kind, detail = fuzz.outcome(data, tmp_path, target="cpu", train=True)
    assert kind == "neoflow error" and "the loss would average over no elements" in detail, detail
