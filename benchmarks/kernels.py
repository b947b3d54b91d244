"""The CPU kernels issue 38 names, each against its bound on this machine.

    python -m benchmarks.kernels [--quick] [--threads 2] [--out benchmarks/kernels_results]

Depthwise and grouped convolutions (forward, and both adjoints together), BatchNorm's training-mode
statistics and adjoint, softmax and LayerNorm rows, and a channel shuffle's transpose, at the sizes
the architectures of ``benchmarks.models`` give them (batch 32, CIFAR-sized images, ViT's 65 tokens).
Each is compiled for the cpu target (fusion ``neoflow``), checked against the interpreter, then timed
(rounds of consecutive calls, median).  Its bound is the slower of its arithmetic at the measured FMA
peak and its compulsory bytes (every input read once, every output written once; intermediates not
at all) at the measured bandwidth: the last-level cache's where they fit in it (the same arrays every
call), else memory's.  ``% of bound`` is the bound over the time: 100 % runs as fast as the memory
system (or the FMA units) allows.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.run import machine, set_threads
from benchmarks.timing import interleaved_rounds

#: the batch every workload has (as ``benchmarks.models``'s training steps)
BATCH = 32


@dataclass
class Kernel:
    """One workload: a graph in the text language (or one op and its adjoints), its arithmetic."""

    name: str
    shape: str
    text: str
    flops: float
    adjoints: bool = False  # time the op's two adjoints (``backward``), not the op
    outputs: tuple[str, ...] = ()  # the graph's outputs where not only the tensors no op reads

    def graph(self):
        """The workload's graph."""
        import neoflow

        return neoflow.graph(self.text, outputs=list(self.outputs) or None)


def _pad(size: int) -> str:
    return f"h + r >= 1 && h + r <= {size} && w + s >= 1 && w + s <= {size}"


def kernels(batch: int = BATCH) -> list[Kernel]:
    """The workloads at ``batch``."""
    n = batch
    depthwise = (
        f"X = tensor([{n}, 96, 32, 32])\nW = tensor([96, 3, 3])\nY = tensor([{n}, 96, 32, 32])\n"
        f"Y[n, c, h, w] = ReduceAdd({{r, s}}, Select({_pad(32)}, X[n, c, h + r - 1, w + s - 1], 0) * W[c, r, s])"
    )
    grouped = (
        f"X = tensor([{n}, 64, 16, 16])\nW = tensor([64, 16, 3, 3])\nY = tensor([{n}, 64, 16, 16])\n"
        f"Y[n, k, h, w] = ReduceAdd({{c, r, s}}, Select({_pad(16)}, X[n, (k // 16) * 16 + c, h + r - 1, w + s - 1], 0)"
        " * W[k, c, r, s])"
    )
    points = n * 32 * 32
    statistics_text = (
        f"X = tensor([{n}, 64, 32, 32])\nM = tensor([64])\nV = tensor([64])\n"
        f"M[c] = ReduceAdd({{n, h, w}}, X[n, c, h, w]) / {points}\n"
        f"V[c] = ReduceAdd({{n, h, w}}, (X[n, c, h, w] - M[c]) * (X[n, c, h, w] - M[c])) / {points}"
    )
    adjoint = (
        f"X = tensor([{n}, 64, 32, 32])\nDY = tensor([{n}, 64, 32, 32])\nM = tensor([64])\nR = tensor([64])\n"
        f"G = tensor([64])\nS1 = tensor([64])\nS2 = tensor([64])\nDX = tensor([{n}, 64, 32, 32])\n"
        "S1[c] = ReduceAdd({n, h, w}, DY[n, c, h, w])\n"
        "S2[c] = ReduceAdd({n, h, w}, DY[n, c, h, w] * (X[n, c, h, w] - M[c]) * R[c])\n"
        f"DX[n, c, h, w] = G[c] * R[c] * (DY[n, c, h, w] - S1[c] / {points} - (X[n, c, h, w] - M[c]) * R[c] * "
        f"S2[c] / {points})"
    )
    rows = n * 4 * 65  # ViT: 4 heads of 65 tokens
    softmax = (
        f"X = tensor([{rows}, 65])\nMX = tensor([{rows}])\nS = tensor([{rows}])\nY = tensor([{rows}, 65])\n"
        "MX[i] = ReduceMax({j}, X[i, j])\n"
        "S[i] = ReduceAdd({j}, exp(X[i, j] - MX[i]))\n"
        "Y[i, j] = exp(X[i, j] - MX[i]) / S[i]"
    )
    tokens = n * 65
    layernorm = (
        f"X = tensor([{tokens}, 128])\nG = tensor([128])\nB = tensor([128])\nMU = tensor([{tokens}])\n"
        f"VA = tensor([{tokens}])\nY = tensor([{tokens}, 128])\n"
        "MU[i] = ReduceAdd({j}, X[i, j]) / 128\n"
        "VA[i] = ReduceAdd({j}, (X[i, j] - MU[i]) * (X[i, j] - MU[i])) / 128\n"
        "Y[i, j] = (X[i, j] - MU[i]) / sqrt(VA[i] + 0.00001) * G[j] + B[j]"
    )
    shuffle = f"X = tensor([{n}, 2, 58, 16, 16])\nY = tensor([{n}, 58, 2, 16, 16])\nY[n, c, g, h, w] = X[n, g, c, h, w]"
    depthwise_flops = 2.0 * 9 * n * 96 * 32 * 32
    grouped_flops = 2.0 * 16 * 9 * n * 64 * 16 * 16
    return [
        Kernel("depthwise conv 3x3", f"{n}x96x32x32", depthwise, depthwise_flops),
        Kernel("depthwise conv 3x3: dX and dW", f"{n}x96x32x32", depthwise, 2 * depthwise_flops, adjoints=True),
        Kernel("grouped conv 3x3 (4 groups)", f"{n}x64x16x16", grouped, grouped_flops),
        Kernel("grouped conv 3x3: dX and dW", f"{n}x64x16x16", grouped, 2 * grouped_flops, adjoints=True),
        Kernel(
            "BatchNorm statistics (mean, variance)",
            f"{n}x64x32x32",
            statistics_text,
            4.0 * n * 64 * 32 * 32,
            outputs=("M", "V"),
        ),
        Kernel("BatchNorm adjoint", f"{n}x64x32x32", adjoint, 12.0 * n * 64 * 32 * 32),
        Kernel("softmax rows", f"{rows}x65", softmax, 4.0 * rows * 65),
        Kernel("LayerNorm rows", f"{tokens}x128", layernorm, 8.0 * tokens * 128),
        Kernel("channel shuffle transpose", f"{n}x2x58x16x16", shuffle, 0.0),
    ]


@dataclass
class Measured:
    kernel: Kernel
    seconds: float
    bytes: float
    bound: float
    limit: str
    error: float


def _compulsory_bytes(tensors: dict[str, tuple[int, ...]], names) -> float:
    return float(sum(4 * math.prod(tensors[name]) for name in names))


def prepare(kernel: Kernel) -> tuple[Callable[[], object], float, float]:
    """The compiled call of ``kernel``, its compulsory bytes and its largest error against the
    interpreter (relative to the largest value)."""
    import neoflow

    graph = kernel.graph()
    rng = np.random.default_rng(0)
    if kernel.adjoints:
        (op,) = graph.ops
        inputs = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in op.inputs}
        seed = {f"d{op.name}": rng.standard_normal(op.shape).astype(np.float32)}
        compiled = neoflow.compile(op, target="cpu", grad=True)
        got = compiled.backward(inputs, seed)
        adjoints = neoflow.grad(op)
        want = {name: neoflow.evaluate(a, {**inputs, **seed}) for name, a in adjoints.items()}
        error = max(float(np.abs(np.asarray(got[name]) - want[name]).max() / np.abs(want[name]).max()) for name in want)
        shapes = {t.name: t.shape for t in op.inputs} | {f"d{op.name}": op.shape}
        read = [t.name for t in op.inputs] + [f"d{op.name}"]
        moved = _compulsory_bytes(shapes, read) + _compulsory_bytes({t.name: t.shape for t in op.inputs}, inputs)
        return (lambda: compiled.backward(inputs, seed)), moved, error
    inputs = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in graph.inputs}
    compiled = neoflow.compile(graph, target="cpu", fusion="neoflow")
    got = compiled.run(inputs)
    want = neoflow.evaluate(graph, inputs)
    error = max(float(np.abs(np.asarray(got[name]) - want[name]).max() / np.abs(want[name]).max()) for name in want)
    shapes = {t.name: t.shape for t in graph.inputs} | {name: np.shape(value) for name, value in want.items()}
    moved = _compulsory_bytes(shapes, [*inputs, *want])
    return (lambda: compiled.run(inputs)), moved, error


def measure(selected: list[Kernel], figures, rounds: int, block: int) -> list[Measured]:
    """Each kernel compiled, checked and timed against its bound (``figures``: the machine's)."""
    results = []
    for kernel in selected:
        print(f"{kernel.name} ...", file=sys.stderr, flush=True)
        call, moved, error = prepare(kernel)
        times = interleaved_rounds({"neoflow": call}, rounds, 2, block)["neoflow"]
        seconds = statistics.median(t for calls in times for t in calls)
        in_cache = moved <= figures.cache_bytes
        bandwidth = figures.cache_bandwidth if in_cache else figures.bandwidth
        memory, arithmetic = moved / bandwidth, kernel.flops / figures.peak_flops
        limit = "FMA peak" if arithmetic > memory else ("cache bandwidth" if in_cache else "memory bandwidth")
        results.append(Measured(kernel, seconds, moved, max(memory, arithmetic), limit, error))
    return results


def table(results: list[Measured], threads: int, figures) -> list[str]:
    """The results as markdown lines."""
    lines = [
        f"Machine: {machine()}; {threads} threads; measured FMA peak {figures.peak_flops / 1e9:.1f} GFLOP/s, "
        f"memory bandwidth {figures.bandwidth / 1e9:.1f} GB/s, last-level cache bandwidth "
        f"{figures.cache_bandwidth / 1e9:.1f} GB/s ({figures.cache_bytes / 2**20:.0f} MiB); median of every call.",
        "",
        "| kernel | shape | error vs interpreter | neoflow ms | compulsory MB | bound ms | bound by | % of bound |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r.kernel.name} | {r.kernel.shape} | {r.error:.1e} | {r.seconds * 1e3:.3f} | {r.bytes / 1e6:.1f} | "
            f"{r.bound * 1e3:.3f} | {r.limit} | {100 * r.bound / r.seconds:.0f} % |"
        )
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 4, fewer rounds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--block", type=int, default=5, help="consecutive calls per round")
    parser.add_argument("--only", default="", help="run only the kernels whose name holds this text")
    parser.add_argument("--out", default="benchmarks/kernels_results", help="write <out>.md")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    from neoflow.targets.cpu.machine import measure_machine

    batch, rounds = (4, 2) if args.quick else (BATCH, args.rounds)
    selected = [k for k in kernels(batch) if args.only in k.name]
    figures = measure_machine(args.threads)
    text = "\n".join(table(measure(selected, figures, rounds, args.block), args.threads, figures))
    print(text)
    if args.out and not args.quick:
        Path(f"{args.out}.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
