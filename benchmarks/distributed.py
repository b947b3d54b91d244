"""Data-parallel training: step time and scaling against one rank, and how much of the all-reduce
the reverse pass hides.

    python -m benchmarks.distributed [--target cpu|cuda] [--ranks 1,2] [--model capsule28] [--batch B]
                                     [--fusion none|neoflow|...] [--out benchmarks/distributed_cpu]

For each rank count the same command runs on that many local workers (torchrun's launcher,
``neoflow.runtime.distributed.launch``; gloo for cpu, NCCL and one GPU per rank for cuda), each
training ``--model`` on a batch of ``--batch`` per rank (weak scaling: the global batch grows with
the ranks), its step's pieces fused under ``--fusion`` (the compiler's default, none, unless
given).  Rank 0 reports, as medians over ``--rounds`` rounds of ``--block`` steps in a row with the
systems taking turns:

- ``step``: a data-parallel step (gradient buckets all-reduced, overlapping the reverse pass); on
  the cuda target steps are queued without waiting for each one's loss (``train_step(wait=False)``),
  as a training loop that reads its loss now and then runs;
- ``no all-reduce``: the same pieces with every collective skipped;
- ``all-reduce alone``: the step's bucket all-reduces one after another with nothing to hide them.

On the cuda target all three are timed on the GPU: a block of calls between two CUDA events on
the step's stream, divided by its calls (the all-reduces captured as one CUDA graph, as the step
captures them, so that neither pays for launching them from the host).  On the cpu target they are
timed on the host, call by call.

``hidden`` is ``1 - (step - no all-reduce) / all-reduce alone``; ``speedup`` is the global batch's
throughput against one rank's (``ranks x step(1) / step(N)``), ``efficiency`` that over the ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import neoflow
from benchmarks.timing import interleaved_rounds
from neoflow.codegen.hardware import cpu_model
from neoflow.runtime import distributed
from neoflow.runtime.fusing import DEFAULT_POLICY

ROOT = Path(__file__).resolve().parents[1]


def _flat_buffers(runner: distributed.DataParallel) -> list:
    """The flat buffers the runner's bucket all-reduces work on (after one step)."""
    return list(runner.arrays.buffers.values())


def worker(args: argparse.Namespace) -> None:
    """One rank's measurements; rank 0 writes them as JSON to ``args.worker``."""
    world = distributed.join(args.target)
    try:
        source = ROOT / "models" / f"{args.model}.onnx"
        spec = neoflow.TrainSpec(optimizer="momentum", lr=0.01)
        probe = neoflow.compile(source, target="interp", train=spec)
        shape = probe.training.data_inputs[0].shape
        shapes = {"x": (args.batch, *shape[1:])}
        model = neoflow.compile(source, target=args.target, train=spec, shapes=shapes, fusion=args.fusion)
        step = distributed.DataParallel(model, world, check_every=0)
        alone = distributed.DataParallel(model, world, check_every=0, reduce=False)
        batch = model.example_batch(training=True, seed=world.rank)
        step.train_step(batch)  # makes the buckets' buffers
        buffers = _flat_buffers(step)
        torch, dist = step.torch, step.dist
        on_device = args.target in distributed.DEVICE_TARGETS

        def all_reduces() -> None:
            for buffer in buffers:
                dist.all_reduce(step.arrays.shared(buffer), op=step.average)

        systems = {  # steps queued as a training loop does that reads its loss now and then (the cuda target)
            "step": lambda: step.train_step(batch, wait=False),
            "no all-reduce": lambda: alone.train_step(batch, wait=False),
            "all-reduce alone": all_reduces,
        }
        if on_device:
            with step.arrays.on_stream():
                systems["all-reduce alone"] = _captured(torch, step.arrays.stream, all_reduces)
                rounds = _device_rounds(torch, step.arrays.stream, systems, args.rounds, args.block)
        else:
            rounds = interleaved_rounds(systems, args.rounds, warmup=3, block=args.block)
        medians = {name: statistics.median(t for calls in times for t in calls) for name, times in rounds.items()}
        if world.rank == 0:
            gpu = torch.cuda.get_device_name() if on_device else None
            report = {
                "ranks": world.size,
                "backend": world.backend,
                "gpu": gpu,
                "threads": os.environ.get("NEOFLOW_NUM_THREADS"),
                "pieces": len(step.split.segments),
                "buckets": [len(b) for b in step.split.buckets],
                "bucket_bytes": [int(b.nbytes) for b in buffers],
                **{name: seconds for name, seconds in medians.items()},
            }
            Path(args.worker).write_text(json.dumps(report))
    finally:
        while _GRAPHS:  # NCCL's leave waits for ever while a graph holding its kernels lives
            _GRAPHS.pop().reset()
        distributed.leave()


#: the CUDA graphs ``_captured`` made, dropped before the process group is left
_GRAPHS: list = []


def _captured(torch, stream, work):
    """``work`` (run 3 times first) captured on ``stream`` as a CUDA graph: its replay."""
    for _ in range(3):
        work()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        work()
    _GRAPHS.append(graph)
    return graph.replay


def _device_rounds(torch, stream, systems: dict, rounds: int, block: int, warmup: int = 3) -> dict:
    """``systems`` timed on the GPU: ``rounds`` rounds, each running every system's ``block``
    calls in a row (round k starting with the k-th system) between two events on ``stream``;
    per system and round, the block's time a call (as ``interleaved_rounds`` gives, one a block)."""
    for work in systems.values():
        for _ in range(warmup):
            work()
    times: dict[str, list[list[float]]] = {name: [] for name in systems}
    names = list(systems)
    for k in range(rounds):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            stream.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for _ in range(block):
                systems[name]()
            end.record(stream)
            end.synchronize()
            times[name].append([start.elapsed_time(end) / 1e3 / block])
    return times


def _row(result: dict, base: dict | None, batch: int) -> list[str]:
    step, without, comm = result["step"], result["no all-reduce"], result["all-reduce alone"]
    hidden = 1.0 if result["ranks"] == 1 else min(1.0, max(0.0, 1 - (step - without) / comm))
    speedup = result["ranks"] * base["step"] / step if base else float("nan")
    return [
        str(result["ranks"]),
        f"{step * 1e3:.3f}",
        f"{without * 1e3:.3f}",
        f"{comm * 1e3:.3f}",
        "-" if result["ranks"] == 1 else f"{hidden:.0%}",
        f"{result['ranks'] * batch / step:.0f}",
        f"{speedup:.2f}x",
        f"{speedup / result['ranks']:.0%}",
    ]


def worker_arguments(args: argparse.Namespace, report: Path) -> list[str]:
    """The command line of a rank's worker: the run's settings, and where rank 0 writes its report."""
    forwarded = ["--target", args.target, "--model", args.model, "--batch", str(args.batch)]
    forwarded += ["--fusion", args.fusion, "--rounds", str(args.rounds), "--block", str(args.block)]
    return [*forwarded, "--worker", str(report)]


def parser() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="cpu", choices=("cpu", "cuda", "interp"))
    parser.add_argument("--ranks", default="1,2", help="rank counts to run, comma-separated (1,2)")
    parser.add_argument("--model", default="capsule", help="a model of models/ (capsule)")
    parser.add_argument("--batch", type=int, default=32, help="batch per rank (32)")
    parser.add_argument("--fusion", default=DEFAULT_POLICY, help=f"fusion policy ({DEFAULT_POLICY})")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--out", default=None, help="write <out>.md")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a rank's JSON report
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    counts = [int(n) for n in args.ranks.split(",")]
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "NCCL_NVLS_ENABLE": "0"}
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for n in counts:
            report = Path(scratch) / f"{n}.json"
            forwarded = worker_arguments(args, report)
            started = time.perf_counter()
            print(f"{n} rank(s): running ...", file=sys.stderr, flush=True)
            distributed.launch(n, ["-m", "benchmarks.distributed", *forwarded], env=env)
            results.append(json.loads(report.read_text()))
            print(f"{n} rank(s): done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    base = next((r for r in results if r["ranks"] == 1), None)
    widest = results[-1]  # one rank reduces nothing: its buckets are not made
    head = ["ranks", "step ms", "no all-reduce ms", "all-reduce alone ms", "hidden", "samples/s", "speedup"]
    head.append("efficiency")
    lines = [
        f"# Data-parallel training: {args.model}, batch {args.batch} per rank, target {args.target}"
        + ("" if args.fusion == DEFAULT_POLICY else f", fusion {args.fusion}"),
        "",
        f"Machine: {widest['gpu'] or cpu_model()} ({os.cpu_count()} cores); "
        f"backend {widest['backend']}; {widest['pieces']} pieces, {len(widest['buckets'])} gradient "
        f"buckets ({', '.join(f'{b / 1024:.0f} KiB' for b in widest['bucket_bytes'])}); medians of "
        f"{args.rounds} rounds of {args.block} steps, the three systems taking turns; "
        f"`python -m benchmarks.distributed {' '.join(argv if argv is not None else sys.argv[1:])}`.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    lines += ["| " + " | ".join(_row(r, base, args.batch)) + " |" for r in results]
    if results[0]["threads"]:
        lines += ["", f"Threads per rank: {', '.join(str(r['threads']) for r in results)} (a share of the cores)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(f"{args.out}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
