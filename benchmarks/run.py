"""neoflow (target cpu) against PyTorch eager, torch.compile, JAX jit and ONNX Runtime, in one process.

    python -m benchmarks.run [--quick] [--only capsule] [--out benchmarks/results]

Every peer runs with the same thread count (``--threads``, default 2); each
timing is the median over ``--runs`` (default 7, at least 5) rounds after a
warm-up, each round running every system ``--block`` (default 3) times in a
row, in turn (single runs taking turns let one library's spinning worker
threads slow the next).  The machine's FMA peak is measured in the same run with a generated
C loop (independent AVX2 FMA chains on every thread).  Writes
``<out>.md`` (a markdown table: times, neoflow's speed-up over each peer,
achieved GFLOP/s and the fraction of peak) and ``<out>.png`` (a bar chart).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.timing import interleaved_medians


def set_threads(threads: int) -> None:
    os.environ["NEOFLOW_NUM_THREADS"] = str(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("XLA_FLAGS", f"--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads={threads}")


def fma_peak() -> float:
    """GFLOP/s of independent float32 FMA chains on every thread (the best of 3;
    the same generated loop the fusion cost model measures)."""
    import ctypes

    from neoflow.targets.cpu.compiler import load_library
    from neoflow.targets.cpu.machine import PROBE_SOURCE

    library = load_library(PROBE_SOURCE)
    library.nf_fma_peak.restype = ctypes.c_double
    library.nf_fma_peak.argtypes = [ctypes.c_long]
    library.nf_fma_peak(10_000_000)
    return max(library.nf_fma_peak(100_000_000) for _ in range(3)) / 1e9


@dataclass
class Workload:
    """One benchmark: its flops (for GFLOP/s) and a callable per system (None: not run)."""

    name: str
    flops: float
    systems: dict[str, Callable[[], object] | None] = field(default_factory=dict)
    goal: str = ""


def torch_compiled(fn: Callable, *args):
    import torch

    try:
        compiled = torch.compile(fn)
        compiled(*args)
        return compiled
    except Exception as err:  # torch.compile needs a working C++ toolchain; report, do not fail
        print(f"torch.compile unavailable: {type(err).__name__}: {str(err).splitlines()[0][:120]}", file=sys.stderr)
        return None


def sgemm(n: int) -> Workload:
    import jax
    import jax.numpy as jnp
    import torch

    import neoflow

    op = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (n, n), "B": (n, n)})
    layer = neoflow.compile(op, target="cpu")
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(np.float32) for _ in range(2))
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    jitted = jax.jit(lambda x, y: x @ y)
    compiled = torch_compiled(lambda x, y: x @ y, ta, tb)
    return Workload(
        f"sgemm {n}^3",
        2.0 * n**3,
        {
            "neoflow": lambda: layer.run({"A": a, "B": b}),
            "torch eager": lambda: ta @ tb,
            "torch.compile": (lambda: compiled(ta, tb)) if compiled else None,
            "jax jit": lambda: jitted(ja, jb).block_until_ready(),
        },
        ">= 85 % of FMA peak",
    )


def capsule(stride: int) -> Workload:
    import jax
    import jax.numpy as jnp
    import torch

    import neoflow
    from tests.runtime.torch_models import capsule_conv

    size = (14 - 1) * stride + 3
    text = (
        f"Out[b, k, p, q, i, j] = ReduceAdd({{c, r, s, t}}, In0[b, c, p*{stride} + r, q*{stride} + s, i, t] "
        "* In1[k, c, r, s, t, j])"
    )
    shapes = {"In0": (16, 32, size, size, 4, 4), "In1": (32, 32, 3, 3, 4, 4)}
    layer = neoflow.compile(neoflow.op(text, shapes=shapes), target="cpu", grad=True)
    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal(s).astype(np.float32) for s in shapes.values())
    dout = rng.standard_normal((16, 32, 14, 14, 4, 4)).astype(np.float32)
    tx, tw, td = (torch.tensor(v) for v in (x, w, dout))

    def torch_step(fn) -> Callable[[], object]:
        def step() -> None:
            xx, ww = tx.clone().requires_grad_(), tw.clone().requires_grad_()
            fn(xx, ww).backward(td)

        return step

    def jax_forward(xx, ww):
        cols = jnp.stack(
            [
                jnp.stack([xx[:, :, r : r + stride * 14 : stride, s : s + stride * 14 : stride] for s in range(3)], 0)
                for r in range(3)
            ],
            0,
        )  # r, s, b, c, p, q, i, t
        return jnp.einsum("rsbcpqit,kcrstj->bkpqij", cols, ww)

    def jax_loss(xx, ww, dd):
        return jnp.sum(jax_forward(xx, ww) * dd)

    jax_grad = jax.jit(jax.value_and_grad(jax_loss, argnums=(0, 1)))
    jx, jw, jd = (jnp.asarray(v) for v in (x, w, dout))
    compiled = torch_compiled(lambda a, b: capsule_conv(a, b, stride), tx, tw)
    macs = 16 * 32 * 14 * 14 * 4 * 4 * 32 * 3 * 3 * 4
    return Workload(
        f"capsule conv stride {stride} fwd+bwd",
        2.0 * macs * 3,
        {
            "neoflow": lambda: layer.forward_backward({"In0": x, "In1": w}, {"dOut": dout}),
            "torch eager": torch_step(lambda a, b: capsule_conv(a, b, stride)),
            "torch.compile": torch_step(compiled) if compiled else None,
            "jax jit": lambda: jax.block_until_ready(jax_grad(jx, jw, jd)),
        },
        ">= 3x torch eager, >= 1.5x the faster of torch.compile and JAX",
    )


def conv2d() -> Workload:
    import torch
    import torch.nn.functional as F

    import neoflow

    text = (
        "Y[n, k, p, q] = ReduceAdd({c, r, s}, Select(p + r - 1 >= 0 && p + r - 1 < 56 && q + s - 1 >= 0 && "
        "q + s - 1 < 56, X[n, c, p + r - 1, q + s - 1], 0) * W[k, c, r, s])"
    )
    shapes = {"X": (8, 64, 56, 56), "W": (64, 64, 3, 3)}
    layer = neoflow.compile(neoflow.op(text, shapes=shapes, out_shape=(8, 64, 56, 56)), target="cpu", grad=True)
    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal(s).astype(np.float32) for s in shapes.values())
    dout = rng.standard_normal((8, 64, 56, 56)).astype(np.float32)
    tx, tw, td = (torch.tensor(v) for v in (x, w, dout))

    def torch_step() -> None:
        xx, ww = tx.clone().requires_grad_(), tw.clone().requires_grad_()
        F.conv2d(xx, ww, padding=1).backward(td)

    macs = 8 * 64 * 56 * 56 * 64 * 9
    return Workload(
        "conv2d 3x3 N8 C=K=64 56x56 fwd+bwd",
        2.0 * macs * 3,
        {"neoflow": lambda: layer.forward_backward({"X": x, "W": w}, {"dY": dout}), "torch eager": torch_step},
        ">= 1.0x torch eager",
    )


def conv2d_bias_relu() -> Workload:
    """Inference of a padded 3x3 conv with its bias and ReLU applied in the blocked kernel's epilogue."""
    import torch
    import torch.nn.functional as F

    import neoflow

    text = (
        "Y[n, k, p, q] = max(ReduceAdd({c, r, s}, Select(p + r - 1 >= 0 && p + r - 1 < 56 && q + s - 1 >= 0 && "
        "q + s - 1 < 56, X[n, c, p + r - 1, q + s - 1], 0) * W[k, c, r, s]) + Bias[k], 0)"
    )
    shapes = {"X": (8, 64, 56, 56), "W": (64, 64, 3, 3), "Bias": (64,)}
    layer = neoflow.compile(neoflow.op(text, shapes=shapes, out_shape=(8, 64, 56, 56)), target="cpu")
    rng = np.random.default_rng(0)
    inputs = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    tx, tw, tb = (torch.tensor(v) for v in inputs.values())

    def torch_forward() -> None:
        with torch.no_grad():
            F.relu(F.conv2d(tx, tw, tb, padding=1))

    return Workload(
        "conv2d 3x3 + bias + ReLU N8 C=K=64 56x56 fwd",
        2.0 * 8 * 64 * 56 * 56 * 64 * 9,
        {"neoflow": lambda: layer.run(inputs), "torch eager": torch_forward},
        ">= 0.8x torch eager",
    )


def four_op() -> Workload:
    import torch
    import torch.nn.functional as F

    import neoflow
    from tests.runtime.torch_models import four_op as torch_four_op

    root = Path(__file__).resolve().parents[1]
    graph = neoflow.graph((root / "models" / "four_op.nf").read_text())
    rng = np.random.default_rng(0)
    a = rng.standard_normal((1, 3, 224, 224)).astype(np.float32)
    c = (rng.standard_normal((64, 3, 3, 3)) / 5).astype(np.float32)
    goal = rng.standard_normal((1, 19, 224, 224)).astype(np.float32)
    spec = neoflow.TrainSpec(loss="mse", labels="target")
    model = neoflow.compile(graph, target="cpu", train=spec, parameters={"A": a, "C": c})
    ta, tc, tg = (torch.tensor(v) for v in (a, c, goal))

    def torch_step() -> None:
        aa, cc = ta.clone().requires_grad_(), tc.clone().requires_grad_()
        F.mse_loss(torch_four_op(aa, cc), tg).backward()

    macs = 64 * 112 * 112 * 27
    return Workload(
        "four-op graph fwd+bwd (mse)",
        2.0 * macs * 3,
        {"neoflow": lambda: model.gradients({"target": goal}), "torch eager": torch_step},
        ">= 1.5x torch eager",
    )


def training_step(kind: str) -> Workload:
    import torch
    import torch.nn.functional as F

    import neoflow
    from tests.runtime.torch_models import MODELS

    root = Path(__file__).resolve().parents[1]
    spec = neoflow.TrainSpec(labels="y", optimizer="sgd", lr=0.05)
    model = neoflow.compile(root / "models" / f"{kind}.onnx", target="cpu", train=spec)
    shape = (32, 64) if kind == "mlp" else (32, 1, 8, 8)
    rng = np.random.default_rng(0)
    batch = {"x": rng.random(shape, np.float32), "y": rng.integers(0, 10, 32)}
    params = {k: torch.tensor(v, requires_grad=True) for k, v in model.parameters().items()}
    forward = MODELS[kind](params)
    optim = torch.optim.SGD(params.values(), lr=0.05)
    tx, ty = torch.from_numpy(batch["x"]), torch.from_numpy(batch["y"])

    def torch_step() -> None:
        optim.zero_grad()
        F.cross_entropy(forward(tx), ty).backward()
        optim.step()

    return Workload(
        f"{kind.upper()} training step (digits, batch 32)",
        0.0,
        {"neoflow": lambda: model.train_step(batch), "torch eager": torch_step},
        ">= 1.0x torch eager",
    )


def inference(kind: str) -> Workload:
    import neoflow

    root = Path(__file__).resolve().parents[1]
    model = neoflow.compile(root / "models" / f"{kind}.onnx", target="cpu")
    shape = (32, 64) if kind == "mlp" else (32, 1, 8, 8)
    x = np.random.default_rng(0).random(shape, np.float32)
    systems: dict[str, Callable[[], object] | None] = {"neoflow": lambda: model.run({"x": x})}
    try:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = int(os.environ["NEOFLOW_NUM_THREADS"])
        session = ort.InferenceSession(
            str(root / "models" / f"{kind}.onnx"), options, providers=["CPUExecutionProvider"]
        )
        systems["onnxruntime"] = lambda: session.run(None, {"x": x})
    except ImportError:
        systems["onnxruntime"] = None
    return Workload(f"{kind.upper()} inference (batch 32)", 0.0, systems, "")


PEERS = ["torch eager", "torch.compile", "jax jit", "onnxruntime"]


def machine() -> str:
    """The CPU model (from /proc/cpuinfo on Linux) and core count."""
    from neoflow.codegen.hardware import cpu_model

    return f"{cpu_model()} ({platform.machine()}), {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer runs and workloads (sgemm 1024 only)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--block", type=int, default=3, help="consecutive runs of a system before the next's turn")
    parser.add_argument("--only", default="", help="run only the workloads whose label holds this text (capsule, ...)")
    parser.add_argument(
        "--out", default=None, help="output prefix (.md and .png; default benchmarks/results, none with --only)"
    )
    args = parser.parse_args(argv)
    set_threads(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    builders: dict[str, Callable[[], Workload]] = {"sgemm 1024": lambda: sgemm(1024)}
    if not args.quick:
        builders["sgemm 2048"] = lambda: sgemm(2048)
    builders |= {
        "capsule conv stride 1": lambda: capsule(1),
        "capsule conv stride 2": lambda: capsule(2),
        "four-op graph": four_op,
        "conv2d 3x3": conv2d,
        "conv2d 3x3 + bias + ReLU": conv2d_bias_relu,
        "MLP training": lambda: training_step("mlp"),
        "CNN training": lambda: training_step("cnn"),
        "MLP inference": lambda: inference("mlp"),
        "CNN inference": lambda: inference("cnn"),
    }
    chosen = {label: build for label, build in builders.items() if args.only in label}
    if not chosen:
        parser.error(f"no workload's label holds '{args.only}' (labels: {', '.join(builders)})")
    runs = max(5, 5 if args.quick else args.runs)
    peak = fma_peak()
    rows = []
    for build in chosen.values():
        work = build()
        measured = interleaved_medians({name: fn for name, fn in work.systems.items() if fn}, runs, block=args.block)
        times = {name: measured.get(name) for name in work.systems}
        rows.append((work, times))
        parts = [f"{name} {t * 1e3:.2f} ms" for name, t in times.items() if t]
        print(f"{work.name}: " + ", ".join(parts), flush=True)
    lines = [
        f"Machine: {machine()}; {args.threads} threads "
        f"for every system; median of {runs} rounds of {args.block} consecutive runs after warm-up, the "
        "systems taking turns round by round; "
        f"measured FMA peak {peak:.1f} GFLOP/s.",
        "",
        "| workload | neoflow | " + " | ".join(PEERS) + " | neoflow GFLOP/s (% of peak) | goal |",
        "| --- | --- | " + " | ".join("---" for _ in PEERS) + " | --- | --- |",
    ]
    for work, times in rows:
        ours = times["neoflow"]
        cells = []
        for peer in PEERS:
            t = times.get(peer)
            cells.append(f"{t * 1e3:.2f} ms ({t / ours:.2f}x)" if t else "-")
        rate = f"{work.flops / ours / 1e9:.1f} ({work.flops / ours / 1e9 / peak:.0%})" if work.flops else "-"
        lines.append(f"| {work.name} | {ours * 1e3:.2f} ms | " + " | ".join(cells) + f" | {rate} | {work.goal} |")
    lines += ["", "(x) = peer time / neoflow time: above 1 means neoflow is faster."]
    print("\n".join(lines))
    if args.out is None and args.only:
        return 0  # a part of the table: printed, not written over the whole one
    out = Path(args.out or "benchmarks/results")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    _plot(rows, out.with_suffix(".png"))
    return 0


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [w.name for w, _ in rows]
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(names) + 1.5))
    height = 0.8 / len(PEERS)
    for k, peer in enumerate(PEERS):
        ratios = [(t[peer] / t["neoflow"]) if t.get(peer) else 0 for _, t in rows]
        ax.barh([i + k * height for i in range(len(names))], ratios, height, label=peer)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(names))], names)
    ax.set_xlabel("speed-up of neoflow (peer time / neoflow time)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
