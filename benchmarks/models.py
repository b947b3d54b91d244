"""Real architectures on the CPU: training steps against PyTorch eager and torch.compile, inference against
ONNX Runtime and torch.compile, and onnx's ``light_*`` models against ONNX Runtime, in one process.

    python -m benchmarks.models [--quick] [--only resnet18,vit] [--out benchmarks/models_results]
    python -m benchmarks.models --tune 240 --only resnet18,vit --skip-light --out benchmarks/models_tuned

The networks are built in PyTorch (``neoflow/architectures.py``) and exported to ONNX the way users do
(TorchScript exporter; training mode without constant folding for training, eval mode for inference).
Before any timing counts, neoflow's losses over the first steps (cross-entropy, SGD with momentum 0.9,
BatchNorm in training mode) must match PyTorch's, and its inference outputs PyTorch's or ONNX Runtime's;
a row that does not match says so and is not timed.  Every system gets the same threads; the systems take
turns block by block (``--block`` consecutive calls, ``--rounds`` rounds: single interleaved calls let one
library's spinning worker threads slow the next); the tables give the median and quartiles of every call
and the ratio of medians.  With ``--tune SECONDS`` each model is also compiled after ``neoflow tune``
measured its kernels for up to that long, and timed in the same rounds ("neoflow tuned": the peers'
ratios are then against it).  Writes ``<out>.md`` and ``<out>.png``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.run import fma_peak, machine, set_threads, torch_compiled
from benchmarks.timing import interleaved_rounds

LIGHT_MODELS = ["resnet50", "squeezenet", "shufflenet", "inception_v1", "densenet121"]
LOSS_STEPS = 3
LEARNING_RATE, MOMENTUM = 0.01, 0.9


@dataclass
class Row:
    """One table row: what ran, the calls per system (None: not run), the check and compile times."""

    name: str
    systems: dict[str, Callable[[], object] | None]
    check: str
    compile_s: float
    times: dict[str, list[float]] = field(default_factory=dict)

    @property
    def checked(self) -> bool:
        return self.check.startswith("ok")


def _stats(calls: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(calls, n=4) if len(calls) > 1 else (calls[0],) * 3
    return median, q1, q3


def _tuned(compiled, source, training: bool, budget: float, **options):
    """``source`` compiled again after ``neoflow tune`` measured ``compiled``'s kernels for up to
    ``budget`` seconds (None where ``budget`` is 0)."""
    if budget <= 0:
        return None
    import neoflow
    from neoflow.runtime.tuning import tune_model

    tune_model(compiled, training, budget)
    return neoflow.compile(source, target="cpu", fusion="neoflow", **options)


def training_row(name: str, batch: int, tune: float = 0.0) -> Row:
    """A training step of architecture ``name``: neoflow against PyTorch eager and torch.compile,
    after checking the first steps' losses."""
    import onnx
    import torch
    import torch.nn.functional as F

    import neoflow
    from neoflow.architectures import build, export

    model = build(name)
    proto = onnx.load_from_string(export(model, batch, train=True))
    spec = neoflow.TrainSpec(labels="labels", optimizer="sgd", lr=LEARNING_RATE, momentum=MOMENTUM)
    start = time.perf_counter()
    compiled = neoflow.compile(proto, target="cpu", fusion="neoflow", train=spec)
    compile_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)
    labels = rng.integers(0, 10, batch)
    tx, ty = torch.from_numpy(x), torch.from_numpy(labels)

    def torch_step(net: torch.nn.Module, forward: Callable) -> Callable[[], float]:
        optimizer = torch.optim.SGD(net.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)

        def step() -> float:
            optimizer.zero_grad()
            loss = F.cross_entropy(forward(tx), ty)
            loss.backward()
            optimizer.step()
            return loss.item()

        return step

    eager_net = copy.deepcopy(model).train()
    eager = torch_step(eager_net, eager_net)
    ours = [compiled.train_step({"x": x, "labels": labels}) for _ in range(LOSS_STEPS)]
    theirs = [eager() for _ in range(LOSS_STEPS)]
    error = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))
    check = f"{'ok' if error <= 1e-3 else 'MISMATCH'}: losses of {LOSS_STEPS} steps to {error:.0e}"
    compiled_net = copy.deepcopy(model).train()
    forward = torch_compiled(compiled_net, tx)
    systems: dict[str, Callable[[], object] | None] = {
        "neoflow": lambda: compiled.train_step({"x": x, "labels": labels}),
        "torch eager": eager,
        "torch.compile": torch_step(compiled_net, forward) if forward is not None else None,
    }
    tuned = _tuned(compiled, proto, True, tune, train=spec)
    if tuned is not None:
        tuned.set_parameters(compiled.parameters())
        systems["neoflow tuned"] = lambda: tuned.train_step({"x": x, "labels": labels})
    return Row(f"{name} training step (batch {batch})", systems, check, compile_s)


def inference_row(name: str, batch: int, threads: int, tune: float = 0.0) -> Row:
    """Inference of architecture ``name`` (eval export): neoflow against ONNX Runtime and torch.compile."""
    import onnx
    import torch

    import neoflow
    from neoflow.architectures import build, export

    model = build(name).eval()
    data = export(model, batch, train=False)
    start = time.perf_counter()
    compiled = neoflow.compile(onnx.load_from_string(data), target="cpu", fusion="neoflow")
    compile_s = time.perf_counter() - start
    x = np.random.default_rng(1).standard_normal((batch, 3, 32, 32)).astype(np.float32)
    tx = torch.from_numpy(x)
    with torch.no_grad():
        want = model(tx).numpy()
        forward = torch_compiled(model, tx)
    error = _relative(compiled.run({"x": x})["y"], want)
    session = _ort_session(data, threads)

    def compiled_forward() -> object:
        with torch.no_grad():
            return forward(tx)

    systems: dict[str, Callable[[], object] | None] = {
        "neoflow": lambda: compiled.run({"x": x}),
        "onnxruntime": lambda: session.run(None, {"x": x}),
        "torch.compile": compiled_forward if forward is not None else None,
    }
    tuned = _tuned(compiled, onnx.load_from_string(data), False, tune)
    if tuned is not None:
        error = max(error, _relative(tuned.run({"x": x})["y"], want))
        systems["neoflow tuned"] = lambda: tuned.run({"x": x})
    return Row(f"{name} inference (batch {batch})", systems, _check(error, "PyTorch"), compile_s)


def light_row(name: str, threads: int, tune: float = 0.0) -> Row:
    """onnx's ``light_<name>`` model: neoflow against ONNX Runtime on the same input."""
    import onnx

    import neoflow

    path = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / f"light_{name}.onnx"
    proto = onnx.load(path)
    start = time.perf_counter()
    compiled = neoflow.compile(proto, target="cpu", fusion="neoflow")
    compile_s = time.perf_counter() - start
    initializers = {t.name for t in proto.graph.initializer}
    (source,) = [v for v in proto.graph.input if v.name not in initializers]
    shape = [d.dim_value for d in source.type.tensor_type.shape.dim]
    x = np.random.default_rng(2).random(shape, np.float32)
    session = _ort_session(path.read_bytes(), threads)
    output = proto.graph.output[0].name
    error = _relative(compiled.run({source.name: x})[output], session.run(None, {source.name: x})[0])
    systems: dict[str, Callable[[], object] | None] = {
        "neoflow": lambda: compiled.run({source.name: x}),
        "onnxruntime": lambda: session.run(None, {source.name: x}),
    }
    tuned = _tuned(compiled, proto, False, tune)
    if tuned is not None:
        error = max(error, _relative(tuned.run({source.name: x})[output], session.run(None, {source.name: x})[0]))
        systems["neoflow tuned"] = lambda: tuned.run({source.name: x})
    return Row(f"light_{name} inference", systems, _check(error, "ONNX Runtime"), compile_s)


def _relative(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / max(np.abs(theirs).max(), 1e-30))


def _check(error: float, peer: str) -> str:
    return f"{'ok' if error <= 1e-4 else 'MISMATCH'}: output to {error:.0e} of {peer}'s"


def _ort_session(model: bytes, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _table(title: str, rows: list[Row], peers: list[str], goal: str) -> list[str]:
    tuned = any(row.times.get("neoflow tuned") for row in rows)
    ours_name = "neoflow tuned" if tuned else "neoflow"
    mine = ["neoflow", "neoflow tuned"] if tuned else ["neoflow"]
    lines = [f"### {title}", "", goal, ""]
    lines.append("| workload | check | neoflow compile | " + " | ".join([*mine, *peers]) + " |")
    lines.append("| --- | --- | --- | " + " | ".join("---" for _ in [*mine, *peers]) + " |")
    for row in rows:
        if not row.times:
            cells = ["not timed", *("-" for _ in [*mine[1:], *peers])]
            lines.append(f"| {row.name} | {row.check} | {row.compile_s:.1f} s | " + " | ".join(cells) + " |")
            continue
        ours = _stats(row.times[ours_name])
        cells = []
        for system in [*mine, *peers]:
            calls = row.times.get(system)
            if not calls:
                cells.append("-")
                continue
            median, q1, q3 = _stats(calls)
            ratio = "" if system == ours_name else f" (**{median / ours[0]:.2f}x**)"
            cells.append(f"{median * 1e3:.2f} ms [{q1 * 1e3:.2f}, {q3 * 1e3:.2f}]{ratio}")
        lines.append(f"| {row.name} | {row.check} | {row.compile_s:.1f} s | " + " | ".join(cells) + " |")
    ratios = {
        peer: [_stats(r.times[peer])[0] / _stats(r.times[ours_name])[0] for r in rows if r.times.get(peer)]
        for peer in ([*peers, "neoflow"] if tuned else peers)
    }
    summary = [
        f"{peer} geomean {statistics.geometric_mean(v):.2f}x, lowest {min(v):.2f}x" for peer, v in ratios.items() if v
    ]
    return [*lines, "", "; ".join(summary) + ".", ""]


def main(argv: list[str] | None = None) -> int:
    from neoflow.architectures import ARCHITECTURES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, batch 8, no light_* models")
    parser.add_argument("--only", default="", help="comma-separated architectures (default: all)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=5, help="consecutive calls of one system per round")
    parser.add_argument("--out", default="benchmarks/models_results", help="output prefix (.md and .png)")
    parser.add_argument("--tune", type=float, default=0.0, metavar="SECONDS", help="neoflow tune each model first")
    parser.add_argument("--skip-light", action="store_true", help="no light_* models")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    # compile times are cold: a kernel cache of their own, empty
    os.environ["NEOFLOW_CACHE_DIR"] = tempfile.mkdtemp(prefix="neoflow-models-")
    import torch

    torch.set_num_threads(args.threads)
    names = [n for n in args.only.split(",") if n] or list(ARCHITECTURES)
    batch = 8 if args.quick else args.batch
    rounds, block = (2, 2) if args.quick else (args.rounds, args.block)
    tables: list[tuple[str, list[Row], list[str], str]] = [
        (
            "Training steps",
            [training_row(n, batch, args.tune) for n in names],
            ["torch eager", "torch.compile"],
            "Goal: >= 1.5x PyTorch eager and >= 1.2x torch.compile on each.",
        ),
        (
            "Inference",
            [inference_row(n, batch, args.threads, args.tune) for n in names]
            + ([] if args.quick or args.skip_light else [light_row(n, args.threads, args.tune) for n in LIGHT_MODELS]),
            ["onnxruntime", "torch.compile"],
            "Goal: geomean >= 1.0x ONNX Runtime, none below 0.8x.",
        ),
    ]
    for _, rows, _, _ in tables:
        for row in rows:
            if row.checked:
                measured = interleaved_rounds({k: fn for k, fn in row.systems.items() if fn}, rounds, 1, block)
                row.times = {k: [t for calls in v for t in calls] for k, v in measured.items()}
            print(f"{row.name}: {row.check}; " + ", ".join(
                f"{k} {_stats(v)[0] * 1e3:.2f} ms" for k, v in row.times.items()
            ), flush=True)  # fmt: skip
    lines = [
        f"Machine: {machine()}; measured FMA peak {fma_peak():.1f} GFLOP/s; {args.threads} threads for every "
        f"system; {rounds} rounds of {block} consecutive calls per system, the systems taking turns round by "
        "round; median [first quartile, third quartile] of every call. (x) = peer time / neoflow time: above 1 "
        f"neoflow is faster. Training: cross-entropy, SGD lr {LEARNING_RATE} momentum {MOMENTUM}, BatchNorm in "
        "training mode; neoflow compile time is cold (no kernel cache)."
        + (
            f" neoflow tuned: compiled again after `neoflow tune` measured its kernels for up to {args.tune:.0f} s;"
            " the peers' ratios are against it."
            if args.tune
            else ""
        ),
        "",
    ]
    for title, rows, peers, goal in tables:
        lines += _table(title, rows, peers, goal)
    out = Path(args.out)
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    _plot(tables, out.with_suffix(".png"))
    return 0


def _plot(tables, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tables), figsize=(7 * len(tables), 5))
    for ax, (title, rows, peers, _) in zip(np.atleast_1d(axes), tables, strict=True):
        timed = [r for r in rows if r.times]
        height = 0.8 / len(peers)
        for k, peer in enumerate(peers):
            ratios = [
                _stats(r.times[peer])[0] / _stats(r.times["neoflow"])[0] if r.times.get(peer) else 0 for r in timed
            ]
            ax.barh([i + k * height for i in range(len(timed))], ratios, height, label=peer)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_yticks([i + 0.4 - height / 2 for i in range(len(timed))], [r.name for r in timed])
        ax.set_xlabel("speed-up of neoflow (peer time / neoflow time)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
