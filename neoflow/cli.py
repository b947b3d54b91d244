"""The ``neoflow`` command line.  It only wires the library's layers together.

Errors are printed as one line on stderr with exit status 1 (2 for bad usage);
set ``NEOFLOW_DEBUG=1`` to see the traceback of an unexpected failure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

import neoflow
from neoflow.errors import InputError, NeoflowError
from neoflow.ir import Graph, Op
from neoflow.ir.interpreter import evaluate_graph


def _shape_arg(text: str) -> tuple[str, tuple[int, ...]]:
    name, sep, dims = text.partition("=")
    try:
        if not sep or not name:
            raise ValueError
        return name.strip(), tuple(int(d) for d in dims.split(",") if d.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=D1,D2,... (e.g. A=1,3,224,224), got '{text}'") from None


def _pair_arg(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got '{text}'")
    return name.strip(), value.strip()


def _program_text(program: str) -> str:
    """``program`` is a file of statements or the statements themselves."""
    path = Path(program)
    if "\n" not in program and "[" not in program and "=" not in program:
        if not path.is_file():
            raise InputError(f"no such file: '{program}'")
        return path.read_text()
    return program


def _load_graph(args: argparse.Namespace) -> Graph:
    if args.program.endswith(".onnx"):
        return neoflow.load_onnx(args.program, shapes=dict(args.shape))
    return neoflow.graph(
        _program_text(args.program), shapes=dict(args.shape), dtypes=dict(args.dtype), dtype=args.default_dtype
    )


def _describe_op(op: Op) -> list[str]:
    sources = dict(op.range_sources)
    reduce_axes = set(op.reduce_axes)

    def ranges(names: Sequence[str]) -> str:
        return ", ".join(f"{v} in [0, {op.extent[v]}) ({sources.get(v, '?')})" for v in names)

    lines = [str(op), f"  output   {op.output}"]
    lines.append("  inputs   " + ", ".join(str(t) for t in op.inputs))
    lines.append("  ranges   " + ranges(op.indices))
    if reduce_axes:
        lines.append("  reduces  " + ranges(op.reduce_axes))
    return lines


def cmd_show(args: argparse.Namespace) -> int:
    graph = _load_graph(args)
    for op in graph.ops:
        print("\n".join(_describe_op(op)))
    inputs = ", ".join(str(t) for t in graph.free_inputs)
    params = sum(v.size for v in graph.parameters.values())
    print(
        f"graph: {len(graph.ops)} op{'s' if len(graph.ops) != 1 else ''}; inputs {inputs}; "
        f"{len(graph.parameters)} parameters ({params} values); outputs {', '.join(graph.outputs)}"
    )
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    graph = _load_graph(args)
    given = dict(args.input)
    rng = np.random.default_rng(args.seed)
    inputs: dict[str, np.ndarray] = {}
    for tensor in graph.free_inputs:
        if tensor.name in given:
            try:
                inputs[tensor.name] = np.load(given.pop(tensor.name), allow_pickle=False)
            except (OSError, ValueError) as err:
                raise InputError(f"cannot read input '{tensor.name}': {err}") from None
        elif args.random:
            inputs[tensor.name] = rng.standard_normal(tensor.shape).astype(tensor.dtype)
        else:
            raise InputError(
                f"no value for input '{tensor.name}' {list(tensor.shape)}: give --input "
                f"{tensor.name}=file.npy or --random"
            )
    if given:
        names = ", ".join(t.name for t in graph.free_inputs)
        raise InputError(f"'{next(iter(given))}' is not an input of the graph (inputs: {names})")
    start = time.perf_counter()
    outputs = evaluate_graph(graph, inputs)
    elapsed = time.perf_counter() - start
    out_dir = Path(args.output) if args.output else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    for name, value in outputs.items():
        print(
            f"{name}: shape {list(value.shape)} {value.dtype}, mean {value.mean():.6g}, "
            f"min {value.min():.6g}, max {value.max():.6g}"
        )
        if out_dir is not None:
            np.save(out_dir / f"{name}.npy", value)
    print(f"interpreter: {elapsed:.3f} s for {len(graph.ops)} ops")
    return 0


def cmd_grad(args: argparse.Namespace) -> int:
    graph = _load_graph(args)
    if len(graph.ops) != 1:
        raise InputError(
            f"grad takes one statement, got {len(graph.ops)} (ops: {', '.join(o.name for o in graph.ops)})"
        )
    op = graph.ops[0]
    print(op)
    start = time.perf_counter()
    adjoints = neoflow.grad(op, args.wrt or None)
    elapsed = time.perf_counter() - start
    for name, adjoint in adjoints.items():
        info = adjoint.info
        print(f"\n{adjoint}")
        print(f"  output   {adjoint.output}")
        if info.kind == "scatter":
            print(f"  kind     scatter-add (the index map of {name} is not affine: {info.reason})")
        else:
            print("  kind     gather")
        axes = ", ".join(f"{axis} in [0, {extent})" for axis, extent in info.new_axes) or "none"
        print(f"  new reduction axes  {axes}")
        print(f"  waste    {info.waste:.1%} of the enumerated (output, reduction) pairs contribute nothing")
    print(f"\nderived {len(adjoints)} adjoint{'s' if len(adjoints) != 1 else ''} in {elapsed * 1e3:.0f} ms")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``neoflow`` command."""
    parser = argparse.ArgumentParser(prog="neoflow", description="A graph-level training compiler.")
    parser.add_argument("--version", action="version", version=f"neoflow {neoflow.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    def program_command(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("program", help="statements in the text language, a file holding them, or an .onnx model")
        sub.add_argument(
            "--shape",
            action="append",
            type=_shape_arg,
            default=[],
            metavar="NAME=D1,D2,...",
            help="shape of a tensor (repeatable)",
        )
        sub.add_argument(
            "--dtype",
            action="append",
            type=_pair_arg,
            default=[],
            metavar="NAME=DTYPE",
            help="dtype of a tensor (repeatable)",
        )
        sub.add_argument("--default-dtype", default="float32", help="dtype of tensors not given (float32)")
        return sub

    show = program_command("show", "Parse statements and print each op with its ranges and output shape.")
    show.set_defaults(func=cmd_show)
    run = program_command("run", "Evaluate statements with the reference interpreter.")
    run.add_argument(
        "--input",
        action="append",
        type=_pair_arg,
        default=[],
        metavar="NAME=FILE.npy",
        help="value of an input tensor (repeatable)",
    )
    run.add_argument("--random", action="store_true", help="fill inputs not given with random normal values")
    run.add_argument("--seed", type=int, default=0, help="seed for --random (0)")
    run.add_argument("-o", "--output", metavar="DIR", help="write each output as DIR/NAME.npy")
    run.set_defaults(func=cmd_run)
    grad = program_command("grad", "Derive the adjoint of each input of one statement and print it.")
    grad.add_argument(
        "--wrt",
        action="append",
        default=[],
        metavar="NAME",
        help="differentiate with respect to this input only (repeatable; default: all float inputs)",
    )
    grad.set_defaults(func=cmd_grad)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except NeoflowError as err:
        print(f"neoflow: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # a bug: still one line unless debugging
        if os.environ.get("NEOFLOW_DEBUG"):
            raise
        print(
            f"neoflow: internal error: {type(err).__name__}: {err} (set NEOFLOW_DEBUG=1 for a traceback)",
            file=sys.stderr,
        )
        return 70


if __name__ == "__main__":
    sys.exit(main())
