"""Fusion policies against each other on the cpu target, in one process.

    python -m benchmarks.fusion [--quick] [--out benchmarks/fusion_results] [--plot docs/fusion-capsule.png]

* the training steps of the seed's four-op graph and of the capsule-conv
  network under ``none``, ``elementwise``, ``neoflow`` and ``chimera``: kernels,
  bytes moved (the cost model's count) and the measured step time: the median
  over ``--runs`` rounds, each running every policy for ``--block`` consecutive
  steps as a training loop does (each step timed), and, for comparison, the median
  of one step a round (each step just after the other policies' steps);
* a GEMM chain ``E = (A @ B) @ D`` (M = L = 1024, K = N = 64): two blocked
  GEMMs (``none``) against ``chimera``'s one kernel with the intermediate in a
  tile buffer, and the tile sizes it chose;
* the cost model's ranking: Spearman's rank correlation between predicted and
  measured kernel times over every kernel of the example models (inference
  and training steps, policies ``none`` and ``neoflow``).

Writes ``<out>.md`` and the capsule network's comparison plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

import numpy as np

from benchmarks.run import machine, set_threads
from benchmarks.timing import interleaved_medians, interleaved_rounds, pooled_medians, round_ratios

MODELS = Path(__file__).resolve().parents[1] / "models"
POLICIES = ("none", "elementwise", "neoflow", "chimera")


def four_op(policy: str):
    """The four-op graph's training step (mse against a target), A and C trained."""
    import neoflow

    rng = np.random.default_rng(0)
    params = {
        "A": rng.standard_normal((1, 3, 224, 224)).astype(np.float32),
        "C": (rng.standard_normal((64, 3, 3, 3)) / 5).astype(np.float32),
    }
    graph = neoflow.graph((MODELS / "four_op.nf").read_text())
    spec = neoflow.TrainSpec(loss="mse", labels="target")
    return neoflow.compile(graph, target="cpu", train=spec, parameters=params, fusion=policy)


def capsule(policy: str):
    """The capsule-conv network's training step (batch 32, cross-entropy, Adam)."""
    import neoflow

    spec = neoflow.TrainSpec(labels="y", optimizer="adam", lr=1e-3)
    return neoflow.compile(MODELS / "capsule.onnx", target="cpu", train=spec, fusion=policy)


def compare_training(build, runs: int, block: int) -> tuple[list, dict[str, float], list[float]]:
    """Per policy: its report (kernels, bytes, per-kernel times) with the step
    time measured in blocks of ``block`` consecutive steps, interleaved with the
    other policies'; each policy's median step timed one step a round; and, round
    by round, how many times faster ``neoflow``'s block ran than ``elementwise``'s."""
    from neoflow.runtime.fusion_report import fusion_report

    models = {policy: build(policy) for policy in POLICIES}
    reports = {policy: fusion_report(model, training=True, repeats=3) for policy, model in models.items()}
    batches = {policy: model.example_batch(training=True) for policy, model in models.items()}
    steps = {
        policy: (lambda model=model, batch=batches[policy]: model.train_step(batch)) for policy, model in models.items()
    }
    rounds = interleaved_rounds(steps, runs, block=block)
    times = pooled_medians(rounds)
    single = interleaved_medians(steps, runs)
    measured = [dataclasses.replace(reports[p], step_seconds=times[p]) for p in models]
    return measured, single, round_ratios(rounds, "elementwise", "neoflow")


def gemm_chain(runs: int, m: int = 1024, width: int = 1024, k: int = 64, n: int = 64) -> dict:
    """Two GEMMs against the chained kernel: median milliseconds and the tiles."""
    import neoflow
    from neoflow.targets.cpu.chain import chain_plan

    text = f"""
A = tensor([{m}, {k}])
B = tensor([{k}, {width}])
D = tensor([{width}, {n}])
C[i, l] = ReduceAdd({{k}}, A[i, k] * B[k, l])
E[i, n] = ReduceAdd({{l}}, C[i, l] * D[l, n])
"""
    graph = neoflow.graph(text)
    rng = np.random.default_rng(0)
    inputs = {name: rng.standard_normal(graph.tensors[name].shape).astype(np.float32) for name in ("A", "B", "D")}
    models = {policy: neoflow.compile(graph, target="cpu", fusion=policy) for policy in ("none", "chimera")}
    expected = inputs["A"].astype(np.float64) @ inputs["B"] @ inputs["D"]
    for model in models.values():
        got = model.run(inputs)["E"]
        assert np.abs(got - expected).max() <= 1e-3 * np.abs(expected).max()
    result = interleaved_medians({p: (lambda model=model: model.run(inputs)) for p, model in models.items()}, runs)
    fused = models["chimera"]._run.graph.ops
    plan = chain_plan(fused[0]) if len(fused) == 1 else None
    flops = 2.0 * m * width * (k + n)
    return {
        "kernels": {p: len(models[p]._run.graph.ops) for p in models},
        "seconds": result,
        "gflops": {p: flops / s / 1e9 for p, s in result.items()},
        "tiles": plan.describe() if plan is not None else "chimera did not chain the GEMMs",
        "shape": (m, width, k, n),
    }


def ranking(repeats: int) -> tuple[float, int]:
    """Spearman's correlation of predicted and measured kernel times over the
    example models' kernels, and how many kernels."""
    import neoflow
    from neoflow.runtime.fusion_report import fusion_report, spearman

    predicted, measured = [], []
    cases = [(MODELS / f"{name}.onnx", False) for name in ("mlp", "cnn", "capsule", "upsampler")]
    cases += [(MODELS / f"{name}.onnx", True) for name in ("mlp", "cnn", "capsule")]
    for path, training in cases:
        for policy in ("none", "neoflow"):
            spec = neoflow.TrainSpec(labels="y") if training else None
            model = neoflow.compile(path, target="cpu", train=spec, fusion=policy)
            for row in fusion_report(model, training, repeats=repeats).rows:
                predicted.append(row.predicted)
                measured.append(row.measured)
    for policy in ("none", "neoflow"):
        model = four_op(policy)
        for training in (False, True):
            for row in fusion_report(model, training, repeats=repeats).rows:
                predicted.append(row.predicted)
                measured.append(row.measured)
    return spearman(predicted, measured), len(predicted)


def _training_section(title: str, measured: tuple[list, dict[str, float], list[float]]) -> list[str]:
    from neoflow.runtime.fusion_report import compare_columns, compare_table, markdown

    reports, single, ratios = measured
    by_policy = {r.policy: r for r in reports}
    base, ours = by_policy["elementwise"], by_policy["neoflow"]
    lines = [f"## {title}", "", markdown(compare_columns(reports), compare_table(reports)), ""]
    lines.append(
        f"neoflow against elementwise: {1 - ours.bytes / base.bytes:.0%} fewer bytes "
        f"({ours.bytes / 1e6:.2f} MB against {base.bytes / 1e6:.2f} MB), step time "
        f"{base.step_seconds / ours.step_seconds:.2f}x ({ours.step_seconds * 1e3:.3f} ms against "
        f"{base.step_seconds * 1e3:.3f} ms); goal: at least 30 % fewer bytes and 1.3x."
    )
    quartiles = np.percentile(ratios, [25, 50, 75])
    lines += [
        "",
        f"Round by round (neoflow's {len(ratios)} blocks against elementwise's in the same round): "
        f"{quartiles[1]:.2f}x median, {quartiles[0]:.2f}x-{quartiles[2]:.2f}x between the quartiles, "
        f"{min(ratios):.2f}x-{max(ratios):.2f}x in all; {np.mean(np.array(ratios) >= 1.3):.0%} of the rounds "
        "at least 1.3x.",
    ]
    lines += [
        "",
        "One step a round (each step right after the other policies' steps, caches theirs): "
        + ", ".join(f"{p} {seconds * 1e3:.3f} ms" for p, seconds in single.items())
        + f"; neoflow against elementwise {single['elementwise'] / single['neoflow']:.2f}x.",
    ]
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer runs")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=101)
    parser.add_argument("--block", type=int, default=5, help="consecutive training steps of a policy per round")
    parser.add_argument("--out", default="benchmarks/fusion_results", help="output prefix (.md)")
    parser.add_argument("--plot", default="docs/fusion-capsule.png", help="the capsule network's comparison plot")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    runs = 5 if args.quick else max(5, args.runs)
    from neoflow.runtime.fusion_report import plot_comparison

    lines = [
        "# Fusion policies (neoflow, target cpu)",
        "",
        f"machine: {machine()}; {args.threads} threads; medians of {runs} rounds after warm-up, "
        f"policies interleaved in one process, each training step policy {args.block} steps in a row a round "
        f"({time.strftime('%Y-%m-%d')})",
        "",
    ]
    print("four-op training step ...", flush=True)
    lines += _training_section("Four-op graph, training step", compare_training(four_op, runs, args.block))
    print("capsule-conv network training step ...", flush=True)
    capsule_measured = compare_training(capsule, runs, args.block)
    lines += _training_section("Capsule-conv network, training step (batch 32)", capsule_measured)
    capsule_reports = capsule_measured[0]
    plot = plot_comparison(capsule_reports, args.plot, "capsule-conv network: training step per fusion policy")
    lines += [f"![capsule-conv network per policy]({os.path.relpath(plot, Path(args.out).parent)})", ""]
    print("GEMM chain ...", flush=True)
    chain = gemm_chain(2 * runs + 1)  # a short kernel: more runs against a noisy host
    m, _, k, _ = chain["shape"]
    ms = {p: s * 1e3 for p, s in chain["seconds"].items()}
    lines += [
        f"## GEMM chain E = (A @ B) @ D, M = L = {m}, K = N = {k}",
        "",
        "| plan | kernels | ms (median) | GFLOP/s |",
        "|---|---|---|---|",
        *(f"| {p} | {chain['kernels'][p]} | {ms[p]:.3f} | {chain['gflops'][p]:.1f} |" for p in ms),
        "",
        f"chimera against two GEMMs: {ms['none'] / ms['chimera']:.2f}x (goal 1.3x). {chain['tiles']}.",
        "",
    ]
    print("cost model ranking ...", flush=True)
    rho, count = ranking(3 if args.quick else 5)
    lines += [
        "## Cost model ranking",
        "",
        f"Spearman's rank correlation of predicted and measured kernel times over {count} kernels "
        f"(mlp, cnn, capsule, upsampler inference; mlp, cnn, capsule, four-op training steps and four-op inference; "
        f"policies none and neoflow): {rho:.3f} (goal 0.8).",
        "",
    ]
    out = Path(args.out).with_suffix(".md")
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {out} and {plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
