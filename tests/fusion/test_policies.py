"""Every fusion policy computes what the unfused graph computes, forward and
training step, on the example models; a user policy plugs in by name."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

import neoflow
from neoflow.errors import CompileError
from neoflow.fusion import BUILT_IN, load_policy
from neoflow.fusion.cost import CostModel, Machine
from neoflow.fusion.patterns import is_epilogue, kind, recomputable, recompute_factor
from neoflow.runtime.fusing import build_executor, cost_model, plan_for
from neoflow.targets.cpu.estimate import schedule
from neoflow.targets.cpu.nest import nest_buffers
from tests.on_targets import NEEDS_CC, TARGETS

MODELS = Path(__file__).resolve().parents[2] / "models"
POLICIES = [*BUILT_IN, "tests.fusion.user_policy:FirstReader"]
INPUTS = {"mlp": (32, 64), "cnn": (32, 1, 8, 8), "capsule": (32, 1, 8, 8), "upsampler": (2, 4, 5, 5)}


def _close(ours: dict, reference: dict) -> None:
    assert set(ours) == set(reference)
    for name, value in reference.items():
        np.testing.assert_allclose(ours[name], value, rtol=2e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("name", sorted(INPUTS))
def test_every_policy_runs_each_example_model_like_none(name: str, target: str) -> None:
    x = np.random.default_rng(0).standard_normal(INPUTS[name]).astype(np.float32)
    reference = neoflow.compile(MODELS / f"{name}.onnx", target="interp").run({"x": x})
    for policy in POLICIES:
        model = neoflow.compile(MODELS / f"{name}.onnx", target=target, fusion=policy)
        _close(model.run({"x": x}), reference)


@pytest.mark.parametrize("name", ["mlp", "cnn", "capsule"])
def test_every_policy_trains_each_example_model_like_none(name: str, target: str) -> None:
    rng = np.random.default_rng(1)
    batch = {"x": rng.standard_normal(INPUTS[name]).astype(np.float32), "y": rng.integers(0, 10, 32)}
    spec = neoflow.TrainSpec(labels="y", optimizer="adam", lr=1e-2)
    reference = neoflow.compile(MODELS / f"{name}.onnx", target="interp", train=spec)
    expected = reference.gradients(batch), reference.train_step(batch), reference.parameters()
    for policy in POLICIES:
        model = neoflow.compile(MODELS / f"{name}.onnx", target=target, train=spec, fusion=policy)
        _close(model.gradients(batch), expected[0])
        assert model.train_step(batch) == pytest.approx(expected[1], rel=1e-5)
        _close(model.parameters(), expected[2])
        assert len(model._train.fusion_plan.kernels) <= len(reference._train.fusion_plan.kernels)


@pytest.mark.parametrize("target", TARGETS[-1:])  # the interpreter takes 25 s here; cpu where there is a compiler
def test_every_policy_trains_the_four_op_graph_like_none(target: str) -> None:
    graph = neoflow.graph((MODELS / "four_op.nf").read_text())
    rng = np.random.default_rng(0)
    a = rng.standard_normal((1, 3, 224, 224)).astype(np.float32)
    c = (rng.standard_normal((64, 3, 3, 3)) / 5).astype(np.float32)
    goal = {"target": rng.standard_normal((1, 19, 224, 224)).astype(np.float32)}
    spec = neoflow.TrainSpec(loss="mse", labels="target", lr=0.5)
    results = {}
    for policy in POLICIES:
        model = neoflow.compile(graph, target=target, train=spec, parameters={"A": a, "C": c}, fusion=policy)
        results[policy] = (model.gradients(goal), model.train_step(goal))
    for policy, (grads, loss) in results.items():
        _close(grads, results["none"][0])
        assert loss == pytest.approx(results["none"][1], rel=1e-5), policy


def test_fusing_policies_make_fewer_kernels_and_store_less_on_the_four_op_step() -> None:
    graph = neoflow.graph((MODELS / "four_op.nf").read_text())
    spec = neoflow.TrainSpec(loss="mse", labels="target")
    rng = np.random.default_rng(0)
    params = {"A": rng.standard_normal((1, 3, 224, 224)), "C": rng.standard_normal((64, 3, 3, 3))}
    plans = {}
    for policy in ("none", "elementwise", "neoflow"):
        model = neoflow.compile(graph, train=spec, parameters=params, fusion=policy)
        plans[policy] = model._train.fusion_plan
    stored = {p: sum(len(k.materialized) for k in plan.kernels) for p, plan in plans.items()}
    assert len(plans["none"].kernels) > len(plans["elementwise"].kernels) >= len(plans["neoflow"].kernels)
    assert stored["none"] > stored["elementwise"] > stored["neoflow"]
    # neoflow inlines the padding into the convolution that reads it (light→heavy): elementwise does not
    assert "B" in plans["neoflow"].kernel_of("D").inlined
    assert "B" in plans["elementwise"].kernel_of("B").materialized


@pytest.mark.parametrize("keep_prediction", [False, True])
def test_neoflow_couples_the_four_op_forward_and_backward_tails_for_the_cpu_target(keep_prediction: bool) -> None:
    # with the cpu target's schedule and nests, F, the loss, its gradient and grad_D (written through
    # the inverse depth-to-space map) come out of one loop nest, and the step moves at least 30 % fewer
    # bytes than under elementwise; F, when the step does not hand it back, stays in the nest's tile
    # buffer, and so does grad_F, which two of the nest's ops read.  The machine's figures are fixed
    # (a 2-core Zen 3 as measured by measure_machine) so that the plan does not depend on the host
    graph = neoflow.graph((MODELS / "four_op.nf").read_text())
    spec = neoflow.TrainSpec(loss="mse", labels="target", keep_prediction=keep_prediction)
    params = {"A": np.zeros((1, 3, 224, 224), np.float32), "C": np.zeros((64, 3, 3, 3), np.float32)}
    planned = neoflow.compile(graph, train=spec, parameters=params, target="interp")._train.planned_graph
    zen3 = Machine(198e9, 4.2e9, 35e9, 2.3e-6, 25.7e9, 104e9, 32e6, measured=True)
    cpu = CostModel(zen3, schedule, nest_buffers)
    plans = {policy: plan_for(planned, policy, cpu) for policy in ("elementwise", "neoflow")}
    moved = {policy: cpu.plan_cost(planned, plan).bytes for policy, plan in plans.items()}
    tail = plans["neoflow"].kernel_of("loss_value")
    assert {"F", "grad_F", "grad_D"} <= set(tail.ops) and {"loss_value", "grad_D"} <= set(tail.materialized)
    assert ("F" in tail.materialized) == keep_prediction and ("F" in tail.buffered) != keep_prediction
    assert "grad_F" in tail.buffered
    assert moved["neoflow"] <= (0.6 if not keep_prediction else 0.7) * moved["elementwise"]


def test_neoflow_recomputes_the_capsule_input_broadcast_in_the_convolutions_that_read_it() -> None:
    # x6 = Reshape(x) inlined leaves c1 summing over c and t of extent one, which only the weights
    # index; with those axes dropped c1 runs the blocked kernel, so recomputing x6 costs nothing
    # and saves its write and reads (machine figures fixed as above)
    model = neoflow.compile(MODELS / "capsule.onnx", train=neoflow.TrainSpec(labels="y"), target="interp")
    planned = model._train.planned_graph
    zen3 = Machine(198e9, 4.2e9, 35e9, 2.3e-6, 25.7e9, 104e9, 32e6, measured=True)
    plan = plan_for(planned, "neoflow", CostModel(zen3, schedule, nest_buffers))
    assert "x6" in plan.kernel_of("c1").inlined and "x6" in plan.kernel_of("grad_k1_").inlined
    assert not any("x6" in kernel.materialized for kernel in plan.kernels)


@pytest.mark.parametrize(("name", "product", "activation"), [("capsule", "c1", "a1"), ("mlp", "h", "a")])
def test_fusing_policies_finish_a_training_steps_relu_in_the_kernel_producing_its_input(
    name: str, product: str, activation: str
) -> None:
    # the ReLU's adjoint reads its output, so the conv's (matmul's) result has one reader, the ReLU:
    # an epilogue; the pre-activation is never stored (machine figures fixed as above); neoflow runs
    # the step slice by slice, where neither is stored: both are slice buffers (fusion.slicing)
    model = neoflow.compile(MODELS / f"{name}.onnx", train=neoflow.TrainSpec(labels="y"), target="interp")
    planned = model._train.planned_graph
    assert [op.name for op in planned.ops if product in op.input_names] == [activation]
    costs = CostModel(Machine(198e9, 4.2e9, 35e9, 2.3e-6, 25.7e9, 104e9, 32e6, measured=True), schedule, nest_buffers)
    elementwise = plan_for(planned, "elementwise", costs).kernel_of(activation)
    assert not elementwise.sliced and product in elementwise.inlined and activation in elementwise.materialized
    sliced = plan_for(planned, "neoflow", costs).kernel_of(activation)
    assert sliced.sliced and {product, activation} <= set(sliced.buffered)


def test_patterns_classify_the_four_op_edges() -> None:
    graph = neoflow.graph((MODELS / "four_op.nf").read_text())
    kinds = {op.name: kind(op) for op in graph.ops}
    assert kinds == {"B": "light", "D": "heavy", "E": "light", "F": "light"}
    assert not is_epilogue(graph.op("D"), graph.op("E"))  # depth-to-space permutes its read
    assert recompute_factor(graph.op("D"), graph.op("E")) == 1.0  # ... but reads each point once
    # inlining the padding into the convolution recomputes it for every output channel and tap that reads it
    assert recompute_factor(graph.op("B"), graph.op("D")) == pytest.approx(64 * 112 * 112 * 27 / (3 * 228 * 228))


def test_a_reduction_of_few_terms_may_be_recomputed_where_it_is_read() -> None:
    row_max = neoflow.op("M[n] = ReduceMax({c}, X[n, c])", shapes={"X": (64, 10)})
    window = neoflow.op("S[n] = ReduceAdd({c}, X[n, c])", shapes={"X": (64, 100)})
    graph = neoflow.graph((MODELS / "four_op.nf").read_text())
    assert recomputable(row_max, 16) and not recomputable(window, 16)  # ten terms a point; a hundred
    assert not recomputable(row_max)  # targets that do not ask for it
    assert recomputable(graph.op("B")) and not recomputable(graph.op("D"), 16)  # light; a 27-term conv


@pytest.mark.parametrize("target", ["tensorcore", "npu"])
def test_the_gpu_plan_recomputes_the_softmax_row_statistics_in_the_losss_readers(target: str) -> None:
    # on a GPU each small kernel costs its launch: the row maximum and sum over 10 classes are
    # evaluated again inside the loss and its gradient rather than stored by kernels of their own
    spec = neoflow.TrainSpec(labels="y", optimizer="sgd", lr=0.05)
    model = neoflow.compile(MODELS / "capsule.onnx", target=target, train=spec, fusion="neoflow")
    plan = model._train.fusion_plan
    own = {kernel.ops[-1] for kernel in plan.kernels}
    recomputed = any("loss_max" in kernel.inlined for kernel in plan.kernels if "grad_logits" in kernel.ops)
    assert ("loss_max" not in own and "loss_sum" not in own and recomputed) == (target == "tensorcore")


def test_a_user_policy_loads_by_module_and_class() -> None:
    policy = load_policy("tests.fusion.user_policy:FirstReader")
    assert policy.name == "first-reader"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("greedy", "unknown fusion policy 'greedy'"),
        ("tests.fusion.no_such_module:X", "cannot import"),
        ("tests.fusion.user_policy:Missing", "has no 'Missing'"),
        ("tests.fusion.user_policy:NotAPolicy", "has no plan"),
    ],
)
def test_bad_policy_names_are_one_line_errors(spec: str, message: str) -> None:
    with pytest.raises(CompileError, match=message) as info:
        load_policy(spec)
    assert "\n" not in str(info.value)


GEMM_CHAIN = """
A = tensor([512, 64])
B = tensor([64, 512])
D = tensor([512, 64])
C[i, l] = ReduceAdd({k}, A[i, k] * B[k, l])
E[i, n] = ReduceAdd({l}, C[i, l] * D[l, n])
"""


def test_chimera_tiles_a_gemm_chain_where_the_target_has_the_kernel() -> None:
    from neoflow.fusion import CostModel, Machine
    from neoflow.targets.cpu.estimate import schedule

    graph = neoflow.graph(GEMM_CHAIN)
    # the cpu's schedule knows the chain kernel: one kernel, C in a tile buffer, with the reason noted
    plan = load_policy("chimera").plan(graph, CostModel(Machine(), schedule))
    assert [k.ops for k in plan.kernels] == [("C", "E")] and plan.kernels[0].inlined == ("C",)
    assert "tiled together" in plan.notes["E"]
    # without it the pair would recompute C for every column of E: kept apart
    plan = load_policy("chimera").plan(graph, CostModel(Machine()))
    assert [k.ops for k in plan.kernels] == [("C",), ("E",)]


@NEEDS_CC
def test_neoflow_runs_ops_that_share_their_reads_as_one_loop_nest_on_cpu() -> None:
    # F, the loss over it and its gradient are all kept: fused, they would each read F's
    # inputs and F again; as one nest the inputs are read once (the cost model says so,
    # from the cpu target's nests) and the three come out of one kernel
    from tests.targets.cpu.test_nest import TAIL

    text = TAIL.replace("[2, 3, 8, 10]", "[2, 3, 64, 64]").replace("[2, 12, 4, 5]", "[2, 12, 32, 32]")
    graph = neoflow.graph(text.replace("[2, 6, 8, 10]", "[2, 6, 64, 64]"))
    executor = build_executor("cpu", graph, ("F", "loss", "G"), "neoflow")
    assert [k.materialized for k in executor.fusion_plan.kernels] == [("F", "loss", "G")]
    assert list(executor.nests) == ["F"]
    rng = np.random.default_rng(5)
    inputs = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in graph.inputs}
    expected = build_executor("interp", graph, ("F", "loss", "G"), "none").run(inputs)
    got = executor.run(inputs)
    for name in ("F", "loss", "G"):
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-4, atol=1e-6)


def test_the_search_sums_a_moves_kernel_costs_in_a_fixed_order() -> None:
    # the order the hash seed gives a set of kernels changed the float sum, and the move taken
    from neoflow.fusion import policies
    from neoflow.fusion.plan import holders

    model = neoflow.compile(MODELS / "cnn.onnx", train=neoflow.TrainSpec(labels="y"), target="interp")
    graph = model._train.planned_graph
    zen3 = Machine(198e9, 4.2e9, 35e9, 2.3e-6, 25.7e9, 104e9, 32e6, measured=True)
    costs = CostModel(zen3, schedule, nest_buffers)
    search = policies._Search(graph, costs)
    groups = [frozenset([op.name]) for op in graph.ops]
    asked: list = []
    priced = costs.kernel_cost

    def recording(graph, kernel):
        asked.append(kernel)
        return priced(graph, kernel)

    costs.kernel_cost = recording
    where = holders(groups)
    for move in policies._moves(graph, groups, search.ops):
        asked.clear()
        search.delta(groups, move, where)
        keys = [policies._kernel_key(kernel) for kernel in asked]
        # the kernels the move makes, then those it unmakes: two runs in order, one descent at most
        assert sum(a > b for a, b in itertools.pairwise(keys)) <= 1, move


def test_the_search_works_out_a_rounds_kernels_once_and_each_round_afresh() -> None:
    # the kernels of the groups a move starts from are the round's; a later round's groups differ
    from neoflow.fusion import policies
    from neoflow.fusion.plan import holders

    model = neoflow.compile(MODELS / "cnn.onnx", train=neoflow.TrainSpec(labels="y"), target="interp")
    graph = model._train.planned_graph
    zen3 = Machine(198e9, 4.2e9, 35e9, 2.3e-6, 25.7e9, 104e9, 32e6, measured=True)
    search = policies._Search(graph, CostModel(zen3, schedule, nest_buffers))
    groups = [frozenset([op.name]) for op in graph.ops]
    where = holders(groups)
    positions = list(range(len(groups)))
    first = search._kernels_of(groups, positions, where)
    assert first == search.grouping.kernels(groups, positions, where)
    assert search._kernels_of(groups, positions[:3], where) == first[:3]  # from the round's memo
    merged = [groups[0] | groups[1], *groups[2:]]  # the next round: its own kernels
    again = search._kernels_of(merged, [0], holders(merged))
    assert again == search.grouping.kernels(merged, [0], holders(merged)) != first[:1]


@pytest.mark.parametrize(
    ("target", "hardware"), [("interp", None), ("cpu", "avx2"), ("tensorcore", "tensorcore"), ("npu", "npu")]
)
def test_a_policy_sees_the_target_it_plans_for(target: str, hardware: str | None) -> None:
    from tests.fusion.user_policy import seen_targets

    graph = neoflow.compile(MODELS / "mlp.onnx", target="interp").inference
    model = cost_model(target)
    assert model.target == target and getattr(model.hardware, "name", None) == hardware
    seen_targets.clear()
    plan = plan_for(graph, "tests.fusion.user_policy:MatrixUnitChains", model)
    assert seen_targets == [(target, hardware)]
    expected = "chimera" if target in ("tensorcore", "npu") else "elementwise"
    assert plan.kernels == plan_for(graph, expected, model).kernels
