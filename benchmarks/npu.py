"""neoflow's NPU target on its own roofline: simulated cycles, cube utilization, bytes and the trade-offs.

    python -m benchmarks.npu [--quick] [--out benchmarks/npu_results]

Every figure is the compiler's static schedule, which the simulator's replay
proves the machine keeps (each program is replayed when it is compiled); no
wall clock is involved, so the figures are the same on every machine.  Each is
set against the machine's own roofline: the cube's peak rate over the cores used
and each path's bandwidth (GM bytes the op must move at least once over HBM).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np

import neoflow
from neoflow.targets.npu.compile import compile_op
from neoflow.targets.npu.counters import Counters, count
from neoflow.targets.npu.machine import Machine, machine
from neoflow.targets.npu.replay import replay

MODELS = Path(__file__).resolve().parents[1] / "models"
CAPSULE = "Out[b, k, p, q, i, j] = ReduceAdd({c, r, s, t}, In[b, c, p*S + r, q*S + s, i, t] * W[k, c, r, s, t, j])"
CONV = (
    "Y[n, k, p, q] = ReduceAdd({c, r, s}, Select(p + r - 1 >= 0 && p + r - 1 < H && q + s - 1 >= 0 && "
    "q + s - 1 < H, X[n, c, p + r - 1, q + s - 1], 0) * W[k, c, r, s])"
)


def op_counters(op, npu: Machine) -> Counters:
    """The counters of ``op`` compiled for ``npu``, every phase replayed against its schedule."""
    compiled = compile_op(op, npu)
    totals = Counters()
    for (_, program), schedule in zip(compiled.phases, compiled.schedules, strict=True):
        replay(program, against=schedule)
        totals.add(count(program, schedule))
    return totals


def compulsory_bytes(ops) -> int:
    """The GM bytes ``ops`` must move at least, each op alone: each of its inputs read once and its
    output written once."""
    return sum(sum(t.size * _itemsize(t.dtype) for t in op.inputs) + op.output.size * _itemsize(op.dtype) for op in ops)


def roofline_cycles(ops, npu: Machine, cores: int, macs: int) -> float:
    """The least cycles ``ops`` could take on ``cores`` cubes: their ``macs`` multiply-adds (the
    unpadded products of their pieces) at the cubes' peak, or their compulsory GM bytes
    (``compulsory_bytes``) over HBM."""
    return max(macs / (npu.cube.macs_per_cycle * cores), compulsory_bytes(ops) / npu.memory.hbm_bytes_per_cycle)


def _itemsize(dtype: str) -> int:
    return np.dtype(np.float16 if dtype == "float16" else dtype).itemsize


def _row(name: str, counters: Counters, bound: float, cores: int) -> str:
    utilization = counters.cube_utilization(cores)
    return (
        f"| {name} | {counters.cycles} | {counters.seconds * 1e6:.1f} | {utilization * 100:.1f} % | "
        f"{counters.ratio('MTE2') * 100:.1f} % | {counters.gm_bytes / 1e6:.2f} | {bound:.0f} | "
        f"{counters.cycles / bound:.2f}x |"
    )


HEADER = (
    "| kernel | cycles | us | cube utilization | MTE2 ratio | GM MB | roofline cycles | over roofline |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- |"
)


def gemm_section(size: int) -> tuple[list[str], float]:
    npu = dataclasses.replace(machine("npu"), cube_cores=1, vector_cores=1)
    op = neoflow.op(
        "C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (size, size), "B": (size, size)}, dtype="float16"
    )
    counters = op_counters(op, npu)
    lines = [f"## GEMM {size}x{size}x{size} fp16 on one core (goal: cube utilization >= 90 %)", "", HEADER]
    lines.append(_row("C = A @ B", counters, roofline_cycles([op], npu, 1, counters.macs), 1))
    return lines, counters.cube_utilization(1)


def _adjoint_ops(op) -> list:
    compiled = neoflow.compile(op, target="interp", grad=True)
    return [op, *(o for o in compiled.backward_graph.ops if o.name != op.name)]


def contraction_section(quick: bool) -> tuple[list[str], list[tuple[str, float, float]]]:
    npu = machine("npu")
    cases = []
    n, hw = (2, 28) if quick else (8, 56)
    shapes = {"X": (n, 64, hw, hw), "W": (64, 64, 3, 3), "Y": (n, 64, hw, hw)}
    conv = neoflow.op(CONV.replace("H", str(hw)), shapes=shapes, dtype="float16")
    cases.append(("conv2d 3x3", conv))
    for stride in (1, 2):
        size = (14 - 1) * stride + 3
        batch = 4 if quick else 16
        caps = neoflow.op(
            CAPSULE.replace("S", str(stride)),
            shapes={"In": (batch, 32, size, size, 4, 4), "W": (32, 32, 3, 3, 4, 4)},
            dtype="float16",
        )
        cases.append((f"capsule conv stride {stride}", caps))
    lines = [
        f"## Convolutions, forward and backward, fp16 tensors, all {npu.cube_cores} cores of `npu` "
        "(goal: cube utilization >= 70 %, within 1.3x of the roofline)",
        "",
        HEADER,
    ]
    summary = []
    for name, op in cases:
        for part in _adjoint_ops(op):
            if not part.reduce_axes:
                continue
            counters = op_counters(part, npu)
            bound = roofline_cycles([part], npu, npu.cube_cores, counters.macs)
            lines.append(_row(f"{name}: {part.name}", counters, bound, npu.cube_cores))
            summary.append((f"{name}: {part.name}", counters.cube_utilization(), counters.cycles / bound))
    return lines, summary


def training_section(preset: str = "npu") -> tuple[list[str], dict]:
    spec = neoflow.TrainSpec(labels="y", optimizer="sgd", lr=0.05)
    lines = [
        f"## Training steps on `{preset}`, all cores: fusion `neoflow` against `none` "
        "(goal: >= 1.5x fewer cycles, >= 40 % fewer GM bytes)",
        "",
        "Compulsory GM MB: what the policy's programs would move if each read its inputs once and wrote its",
        "output once; the last column is the share of GM bytes the plan saves at that bound.",
        "",
        "| model | policy | programs | cycles | GM MB | compulsory GM MB | cycles none / neoflow | GM bytes saved "
        "| saved, compulsory |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    found = {}
    for model in ("capsule28.onnx", "cnn.onnx", "capsule.onnx"):
        rows = {}
        for policy in ("none", "neoflow"):
            compiled = neoflow.compile(MODELS / model, target=preset, train=spec, fusion=policy)
            executor = compiled._train
            rows[policy] = (len(executor.programs), executor.total(), compulsory_bytes(executor.graph.ops))
        base, ours = rows["none"], rows["neoflow"]
        speedup, saved = base[1].cycles / ours[1].cycles, 1 - ours[1].gm_bytes / base[1].gm_bytes
        bound = 1 - ours[2] / base[2]
        found[model] = (speedup, saved, bound)
        for policy, (programs, counters, compulsory) in rows.items():
            extra = f"{speedup:.2f}x | {saved * 100:.0f} % | {bound * 100:.1f} %" if policy == "neoflow" else " | | "
            lines.append(
                f"| {model} | {policy} | {programs} | {counters.cycles} | {counters.gm_bytes / 1e6:.2f} "
                f"| {compulsory / 1e6:.2f} | {extra} |"
            )
    return lines, found


def sweep_section() -> tuple[list[str], list[tuple]]:
    """Cycles of capsule28's training step as L1/UB capacity and core count change."""
    spec = neoflow.TrainSpec(labels="y", optimizer="sgd", lr=0.05)
    base = machine("npu")
    # the step as the npu's own fusion plan makes it (its ops), compiled again for each machine
    graph = neoflow.compile(MODELS / "capsule28.onnx", target="npu", train=spec, fusion="neoflow")._train.graph
    rows = []
    for scale in (0.25, 0.5, 1.0):
        buffers = tuple(
            dataclasses.replace(b, capacity=int(b.capacity * scale) // b.alignment * b.alignment)
            if b.name in ("L1", "UB")
            else b
            for b in base.buffers
        )
        for cores in (8, 16, 32):
            npu = dataclasses.replace(base, buffers=buffers, cube_cores=cores, vector_cores=cores)
            total = Counters()
            for op in graph.ops:
                total.add(op_counters(op, npu))
            rows.append((scale, cores, total.cycles, total.gm_bytes))
    lines = [
        "## Trade-offs: capsule28's training step against L1/UB capacity and cores (`npu`, fusion `neoflow`)",
        "",
        "| L1 / UB | cores | cycles | GM MB |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {s:.2f}x | {c} | {cy} | {b / 1e6:.2f} |" for s, c, cy, b in rows]
    return lines, rows


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for scale in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == scale]
        axes.plot([r[1] for r in mine], [r[2] for r in mine], marker="o", label=f"L1/UB x{scale}")
    axes.set_xlabel("cores")
    axes.set_ylabel("cycles (capsule28 training step)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes (a 1024^3 GEMM, batch 2 and 4)")
    parser.add_argument("--out", default="benchmarks/npu_results", help="results stem: writes .md and .png")
    args = parser.parse_args(argv)
    out = Path(args.out)
    sections = ["# neoflow npu: simulated cycles against the machine's roofline", ""]
    sections.append(machine("npu").describe().splitlines()[0])
    sections.append("")
    lines, _ = gemm_section(1024 if args.quick else 4096)
    sections += [*lines, ""]
    print("\n".join(lines), flush=True)
    lines, _ = contraction_section(args.quick)
    sections += [*lines, ""]
    print("\n".join(lines), flush=True)
    for preset in ("npu", "npu-split"):
        lines, _ = training_section(preset)
        sections += [*lines, ""]
        print("\n".join(lines), flush=True)
    lines, rows = sweep_section()
    sections += [*lines, ""]
    print("\n".join(lines), flush=True)
    out.with_suffix(".md").write_text("\n".join(sections) + "\n")
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
