"""The ``neoflow`` command line.  It only wires the library's layers together.

Errors are printed as one line on stderr with exit status 1 (2 for bad usage);
set ``NEOFLOW_DEBUG=1`` to see the traceback of an unexpected failure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
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


def _seed_arg(text: str) -> int:
    """A seed: a non-negative integer (NumPy's generators take no other)."""
    try:
        seed = int(text)
    except ValueError:
        seed = -1
    if seed < 0:
        raise argparse.ArgumentTypeError(f"a seed is a non-negative integer, got '{text}'")
    return seed


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


def _random_or_given(tensors, given: dict[str, str], random: bool, seed: int) -> dict[str, np.ndarray]:
    """Input arrays: from ``--input NAME=file.npy`` or (with ``--random``) random normal."""
    rng = np.random.default_rng(seed)
    inputs: dict[str, np.ndarray] = {}
    for name, tensor in tensors:
        if name in given:
            try:
                inputs[name] = np.load(given.pop(name), allow_pickle=False)
            except (OSError, ValueError) as err:
                raise InputError(f"cannot read input '{name}': {err}") from None
        elif random:
            inputs[name] = rng.standard_normal(tensor.shape).astype(tensor.dtype)
        else:
            raise InputError(
                f"no value for input '{name}' {list(tensor.shape)}: give --input {name}=file.npy or --random"
            )
    if given:
        names = ", ".join(name for name, _ in tensors)
        raise InputError(f"'{next(iter(given))}' is not an input of the graph (inputs: {names})")
    return inputs


def _require_file(path: str) -> None:
    """An ``InputError`` before any work where the model file ``path`` is not there."""
    if not Path(path).is_file():
        raise InputError(f"no such file: '{path}'")


def _output_dir(output: str | None) -> Path | None:
    """The ``-o DIR`` of ``run``, checked before anything runs (made only when outputs are written)."""
    if output is None:
        return None
    path = Path(output)
    if path.exists() and not path.is_dir():
        raise InputError(f"cannot write outputs into '{output}': it exists and is not a directory")
    existing = next(parent for parent in (path, *path.parents) if parent.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"cannot write outputs into '{output}': '{existing}' is not a writable directory")
    return path


def _report_outputs(outputs: dict[str, np.ndarray], out_dir: Path | None) -> None:
    if out_dir is not None:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise InputError(f"cannot make the output directory '{out_dir}': {err.strerror or err}") from None
    for name, value in outputs.items():
        print(
            f"{name}: shape {list(value.shape)} {value.dtype}, mean {value.mean():.6g}, "
            f"min {value.min():.6g}, max {value.max():.6g}"
        )
        if out_dir is not None:
            try:
                np.save(out_dir / f"{name}.npy", value)
            except OSError as err:
                raise InputError(f"cannot write '{out_dir / name}.npy': {err.strerror or err}") from None


def _run_build(args: argparse.Namespace) -> int:
    out_dir = _output_dir(args.output)
    model = neoflow.load(args.program, shapes=dict(args.shape))  # the saved shapes, those given replaced
    tensors = [(model.public_name(t.name), t) for t in model.inference.free_inputs]
    inputs = _random_or_given(tensors, dict(args.input), args.random, args.seed)
    start = time.perf_counter()
    outputs = model.run(inputs)
    elapsed = time.perf_counter() - start
    _report_outputs(outputs, out_dir)
    print(f"target {model.target}: {elapsed:.4f} s for {len(model.inference.ops)} ops")
    executor = model.inference_executor
    if hasattr(executor, "op_counters"):  # the NPU model: the simulated run's counters
        print(executor.report(), end="")
        return 0
    describe = getattr(executor, "describe", None)
    if describe is not None:  # the tensor-core model: each kernel's predicted GPU time
        rows = describe()
        print(f"predicted on {_gpu_name()}: {sum(t for _, _, t in rows) * 1e3:.3f} ms in {len(rows)} kernels")
        for name, what, seconds in rows:
            print(f"  {name}: {what}, {seconds * 1e6:.1f} us")
    return 0


def _gpu_name() -> str:
    from neoflow.targets.cuda.timing import H100

    return H100.name


def cmd_run(args: argparse.Namespace) -> int:
    if Path(args.program).is_dir():
        return _run_build(args)
    out_dir = _output_dir(args.output)
    graph = _load_graph(args)
    inputs = _random_or_given([(t.name, t) for t in graph.free_inputs], dict(args.input), args.random, args.seed)
    start = time.perf_counter()
    outputs = evaluate_graph(graph, inputs)
    elapsed = time.perf_counter() - start
    _report_outputs(outputs, out_dir)
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


def _train_spec(args: argparse.Namespace) -> neoflow.TrainSpec | None:
    if not args.train:
        return None
    return neoflow.TrainSpec(
        loss=args.loss,
        labels=args.labels,
        output=args.output_name,
        optimizer=args.optimizer,
        lr=args.lr,
        momentum=args.momentum,
        nesterov=args.nesterov,
        weight_decay=args.weight_decay,
        betas=tuple(args.betas),
        eps=args.eps,
        frozen=tuple(args.freeze),
        seed=args.seed,
        keep_prediction=args.loss == "cross_entropy",  # neoflow train counts the training accuracy from it
    )


def cmd_compile(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    model = neoflow.compile(
        args.model,
        target=args.target,
        train=_train_spec(args),
        shapes=dict(args.shape),
        fusion=args.fusion,
        precision=args.precision,
    )
    elapsed = time.perf_counter() - start
    out = model.save(args.output)
    print(model.report())
    written = ", ".join(sorted(p.name for p in out.iterdir() if not p.name.startswith(".")))
    print(f"compiled in {elapsed:.2f} s; wrote {out}/ ({written})")
    return 0


def cmd_fuse(args: argparse.Namespace) -> int:
    from neoflow.fusion.policies import load_policy
    from neoflow.runtime import fusion_report as fr

    policies = [p.strip() for p in (args.compare or args.policy).split(",") if p.strip()]
    if not policies:
        raise InputError("--compare needs at least one policy")
    for policy in policies:
        load_policy(policy)  # a bad name fails before anything is compiled
    if (args.model is None) == (args.corpus is None):
        raise InputError("give a model or --corpus (not both)")
    if args.corpus is not None:
        return _fuse_corpus(args, policies)
    if args.plot and not args.compare:
        raise InputError("--plot draws a comparison: give --compare POLICY,POLICY,...")
    if args.repeats < 1:
        raise InputError(f"--repeats must be at least 1, got {args.repeats}")
    if args.rounds < 2:
        raise InputError(f"--rounds must be at least 2 (an interval needs rounds), got {args.rounds}")
    if args.seconds is not None and not 0 < args.seconds < float("inf"):
        raise InputError(f"--seconds must be a positive number, got {args.seconds}")
    for path in (args.report, args.plot):
        if path is not None and not Path(path).parent.is_dir():
            raise InputError(f"no such directory for '{path}'")
    _require_file(args.model)
    spec = _train_spec(args)
    step = "training step" if args.train else "inference"
    reports, models = [], {}
    comparing = len(policies) > 1
    for policy, key in zip(policies, fr.labels(policies), strict=True):
        print(f"policy {policy}: compiling and timing the {step} ...", file=sys.stderr, flush=True)
        model = neoflow.compile(args.model, target=args.target, train=spec, shapes=dict(args.shape), fusion=policy)
        models[key] = model
        reports.append(fr.fusion_report(model, args.train, args.repeats, args.seed, whole_step=not comparing))
    comparison = None
    if comparing:
        budget = f"{args.seconds:g} s" if args.seconds else f"{args.rounds} rounds"
        print(f"timing the policies' steps against each other ({budget}) ...", file=sys.stderr, flush=True)
        comparison = fr.compare_steps(models, args.train, args.rounds, args.seconds, args.seed)
        reports = fr.with_step_times(reports, comparison)
    sections = []
    for report in reports:
        title = f"{Path(args.model).name}, {report.step}, policy {report.policy} (target {report.target})"
        table = fr.markdown(fr.KERNEL_COLUMNS, fr.kernel_table(report))
        notes = "".join(f"\n- {kernel}: {note}" for kernel, note in report.notes.items())
        sections.append(f"## {title}\n\n{table}\n\nmeasured step: {report.step_seconds * 1e3:.3f} ms (median){notes}")
    if comparison is not None:
        table = fr.markdown(fr.compare_columns(reports, comparison), fr.compare_table(reports, comparison))
        sections.append(
            f"## {Path(args.model).name}, {step}: policies compared\n\n{_how_compared(comparison)}\n\n{table}"
        )
    title = f"{Path(args.model).name}: {step} per fusion policy"
    _write_outputs(
        "\n\n".join(sections) + "\n", args, lambda: fr.plot_comparison(reports, args.plot, title, comparison)
    )
    return 0


def _write_outputs(text: str, args: argparse.Namespace, plot: Callable[[], object]) -> None:
    """Print ``text``; write it to ``--report`` and the figure (``plot()``) to ``--plot`` where given."""
    print(text, end="")
    if args.report:
        Path(args.report).write_text(text)
        print(f"wrote {args.report}")
    if args.plot:
        plot()
        print(f"wrote {args.plot}")


def _fuse_corpus(args: argparse.Namespace, policies: list[str]) -> int:
    """``neoflow fuse --corpus``: every policy on every corpus model and target, one table, one plot."""
    from neoflow import corpus
    from neoflow.targets import check_target

    targets = [t.strip() for t in args.target.split(",") if t.strip()]
    for target in targets:
        check_target(target)
    for path in (args.report, args.plot):
        if path is not None and not Path(path).parent.is_dir():
            raise InputError(f"no such directory for '{path}'")
    rows = corpus.run(
        policies,
        targets,
        args.train,
        Path(args.corpus) if args.corpus else None,
        architectures=not args.no_architectures,
        measure=not args.no_measure,
        rounds=args.rounds,
        seconds=args.seconds,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    step = "training steps" if args.train else "inference"
    ranking = corpus.ranking(rows)
    lines = [f"## Fusion corpus: {step}, policies {', '.join(policies)}", "", corpus.table(rows), ""]
    lines.append("Ranking per target (geometric mean over the models of each policy's predicted time over the best's):")
    lines += [
        f"- {target}: " + ", ".join(f"{p} {v:.3f}x" for p, v in sorted(found.items(), key=lambda kv: kv[1]))
        for target, found in ranking.items()
    ]
    title = f"fusion corpus: {step}, predicted time over the best policy's"
    _write_outputs("\n".join(lines) + "\n", args, lambda: corpus.plot(rows, args.plot, title))
    return 0


def _how_compared(comparison) -> str:
    """The line above a comparison's table: the machine and how the steps were timed."""
    if not comparison.rounds:
        return f"Machine: {comparison.machine}; step times are the target's predicted times (exact)."
    return (
        f"Machine: {comparison.machine}; {comparison.rounds} rounds of {comparison.block} consecutive steps per "
        "policy, the policies taking turns (the order rotating round by round); medians, 95 % bootstrap intervals "
        "of the rounds' medians and of the round-by-round ratios to the first policy; a verdict says faster or "
        "slower only where the interval excludes 1 and the ratio is off it by 2 % or more; `same plan` where a "
        "policy's plan is the first's, kernel for kernel (its measured difference is the machine's)."
    )


def cmd_tune(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from neoflow.fusion.policies import load_policy
    from neoflow.runtime import tuning

    if not 0 < args.budget < float("inf"):
        raise InputError(f"--budget must be a positive number of seconds, got {args.budget}")
    _require_file(args.model)
    load_policy(args.fusion)
    tuning.check_can_tune(args.target)
    spec = _train_spec(args)
    step = "training step" if args.train else "inference"
    options = {"target": args.target, "train": spec, "shapes": dict(args.shape), "fusion": args.fusion}
    if args.precision is not None:
        options["precision"] = args.precision
    print(f"compiling the {step} untuned ...", file=sys.stderr, flush=True)
    with tuning.untuned():
        before = neoflow.compile(args.model, **options)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    show_bar = not args.no_progress and sys.stderr.isatty()
    with Progress(*columns, console=Console(stderr=True), disable=not show_bar, transient=True) as bar:
        task = bar.add_task("tuning", total=None)

        def progress(done: int, total: int, op: str) -> None:
            bar.update(task, completed=done, total=total, description=f"tuning {op}" if op else "tuned")
            if not show_bar and op:
                print(f"tuning kernel {done + 1}/{total}: {op}", file=sys.stderr, flush=True)

        report = tuning.tune_model(before, args.train, args.budget, args.retune, progress, args.seed)
    if not report.rows and not report.known and not report.left:
        print(
            "no kernel of this model runs alone with more than one way to lower it (ops inside loop nests and "
            "sliced kernels of the fusion plan are not tuned; --fusion none runs every op alone)"
        )
        return 0
    print("| kernel | choice | default ms | tuned ms | speedup | candidates |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in report.rows:
        print(
            f"| {row.kernel} | {row.choice} | {row.default_seconds * 1e3:.3f} | {row.seconds * 1e3:.3f} | "
            f"{row.speedup:.2f}x | {row.candidates} |"
        )
    rejected = [f"{row.kernel}: {', '.join(row.rejected)}" for row in report.rows if row.rejected]
    if rejected:
        reasons = "their output differed from the default's, or they spill registers"
        print(f"candidates not used ({reasons}): " + "; ".join(rejected))
    print(
        f"{len(report.rows)} {'piece(s)' if args.target == 'cuda' else 'kernel(s)'} tuned, {report.known} "
        f"{'op(s)' if args.target == 'cuda' else 'kernel(s)'} tuned before (--retune measures them again), "
        f"{report.left} left when the budget ran out; results in {report.table}"
    )
    print(f"compiling the {step} tuned ...", file=sys.stderr, flush=True)
    after = neoflow.compile(args.model, **options)
    untuned_s, tuned_s = tuning.compare_steps(before, after, args.train, args.seed)
    print(
        f"{step}: {untuned_s * 1e3:.3f} ms untuned, {tuned_s * 1e3:.3f} ms tuned "
        f"({untuned_s / tuned_s:.2f}x; medians of blocks of "
        f"{'CUDA-graph replays' if args.target == 'cuda' else 'steps'} taking turns)"
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from neoflow.runtime import distributed

    if args.nproc is not None and args.nproc < 1:
        raise InputError(f"--nproc must be at least 1, got {args.nproc}")
    if args.nproc is not None and args.nproc > 1 and not distributed.launched():
        # the same command on N local workers, through torchrun's launcher; each joins the group
        distributed.launch(args.nproc, ["-m", "neoflow.cli", *_without_option(args.argv, "--nproc")])
        return 0
    if not distributed.launched():
        return _train(args, None)
    distributed.claim_device()  # each rank its own GPU, before the build is loaded
    try:
        return _train(args, distributed)
    finally:
        distributed.leave()


def _train(args: argparse.Namespace, distributed) -> int:
    """``neoflow train`` in this process: alone (``distributed`` None) or as one rank of a
    data-parallel run (the ``runtime.distributed`` module), where ``--batch`` is the global batch
    and rank 0 alone prints and writes."""
    from neoflow.runtime.datasets import load_dataset
    from neoflow.runtime.trainer import Trainer

    if args.epochs < 1:
        raise InputError(f"--epochs must be at least 1, got {args.epochs}")
    if args.batch is not None and args.batch < 1:
        raise InputError(f"--batch must be at least 1, got {args.batch}")
    model = neoflow.load(args.build)
    if model.training is None:
        raise InputError(f"'{args.build}' holds an inference build; compile it with --train")
    world = distributed.join(model.target) if distributed is not None else None
    ranks = world.size if world is not None else 1
    if args.batch is not None and args.batch % ranks:
        raise InputError(f"--batch {args.batch} (the global batch) is not a multiple of the {ranks} ranks")
    batch = args.batch // ranks if args.batch is not None else None
    if batch is not None and batch != model.training.data_inputs[0].shape[0]:
        source = model.public_name(model.training.data_inputs[0].name)
        shape = (batch, *model.training.data_inputs[0].shape[1:])
        model = neoflow.load(args.build, shapes={source: shape})
    if args.lr is not None:
        model.lr = args.lr
    runner = distributed.DataParallel(model, world, sync_bn=args.sync_bn) if world is not None else None
    lead = world is None or world.rank == 0
    say = print if lead else _silent
    data = load_dataset(args.data, seed=args.seed)
    trainer = Trainer(model, data, seed=args.seed, runner=runner)
    per_rank = f" ({trainer.batch} on each of {ranks} ranks, {world.backend})" if world is not None else ""
    say(
        f"training on {data.name}: {len(trainer.x_train)} samples, {len(trainer.x_test)} test samples, "
        f"batch {trainer.global_batch}{per_rank}, {args.epochs} epochs, target {model.target}"
    )
    checkpoint = (lambda: model.save(args.build)) if args.checkpoint and lead else None
    show_bar = lead and not args.no_progress and sys.stderr.isatty()
    results = _train_epochs(trainer, args.epochs, show_bar, checkpoint, say)
    if not lead:
        return 0
    out = model.export_onnx(args.output or Path(args.build) / "trained.onnx")
    total = sum(r.seconds for r in results)
    final = results[-1].test_accuracy
    accuracy = f"test accuracy {final:.1%}" if final is not None else f"loss {results[-1].loss:.4f}"
    print(f"{accuracy} after {len(results)} epoch{'s' if len(results) != 1 else ''} in {total:.1f} s; wrote {out}")
    return 0


def _silent(*_: object, **__: object) -> None:
    """What a rank other than 0 prints: nothing."""


def _without_option(argv: Sequence[str], option: str) -> list[str]:
    """``argv`` without ``option`` and its value (``--opt V`` or ``--opt=V``)."""
    kept, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word == option:
            skip = True
        elif not word.startswith(option + "="):
            kept.append(word)
    return kept


def _train_epochs(
    trainer: object,
    epochs: int,
    show_bar: bool,
    checkpoint: Callable[[], object] | None,
    say: Callable[[str], object] = print,
) -> list:
    """Run the epochs with a progress bar (on a terminal) and one line per epoch (through ``say``),
    calling ``checkpoint`` (where given) after each."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    results = []
    columns = (
        TextColumn("epoch {task.fields[epoch]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}  acc {task.fields[acc]}  {task.fields[rate]:.0f} samples/s"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), disable=not show_bar, transient=True) as bar:
        for number in range(1, epochs + 1):
            task = bar.add_task("train", total=None, epoch=f"{number}/{epochs}", loss=0.0, acc="-", rate=0.0)

            def update(p, task=task) -> None:
                acc = "-" if p.accuracy is None else f"{p.accuracy:.1%}"
                bar.update(task, completed=p.batch, total=p.batches, loss=p.loss, acc=acc, rate=p.samples_per_second)

            result = trainer.epoch(number, update)
            bar.remove_task(task)
            results.append(result)
            parts = [f"epoch {number}/{epochs}", f"loss {result.loss:.4f}"]
            if result.train_accuracy is not None:
                parts.append(f"train acc {result.train_accuracy:.1%}")
            if result.test_accuracy is not None:
                parts.append(f"test acc {result.test_accuracy:.1%}")
            parts.append(f"{result.samples_per_second:.0f} samples/s")
            parts.append(f"{result.seconds:.1f} s")
            if checkpoint is not None:
                checkpoint()
                parts.append("saved")
            say("  ".join(parts))
    return results


def _training_options(command: argparse.ArgumentParser) -> None:
    """The options of a training step (``--train`` and what it is made of)."""
    command.add_argument("--train", action="store_true", help="add a training step (loss, backward, optimizer)")
    command.add_argument("--loss", default="cross_entropy", help="cross_entropy, mse, or a scalar output's name")
    command.add_argument("--labels", default="labels", help="name of the label input (labels)")
    command.add_argument("--output-name", default=None, metavar="NAME", help="the model output the loss reads")
    command.add_argument("--optimizer", default="sgd", help="sgd, momentum, nesterov, adam or adamw (sgd)")
    command.add_argument("--lr", type=float, default=0.01, help="learning rate (0.01)")
    command.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (0; 0.9 for momentum/nesterov)")
    command.add_argument("--nesterov", action="store_true", help="Nesterov momentum")
    command.add_argument("--weight-decay", type=float, default=0.0, help="weight decay (decoupled for adamw)")
    command.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999), metavar=("B1", "B2"), help="Adam betas")
    command.add_argument("--eps", type=float, default=1e-8, help="Adam epsilon (1e-8)")
    command.add_argument("--freeze", action="append", default=[], metavar="NAME", help="do not train this parameter")
    command.add_argument(
        "--seed", type=_seed_arg, default=0, help="dropout noise seed, and the random batch's seed (0)"
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``neoflow`` command."""
    parser = argparse.ArgumentParser(prog="neoflow", description="A graph-level training compiler.")
    parser.add_argument("--version", action="version", version=f"neoflow {neoflow.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    def program_command(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument(
            "program",
            help="statements in the text language, a file holding them, an .onnx model, or (run) a build directory",
        )
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
    run = program_command("run", "Evaluate statements with the interpreter, or run a build directory on its target.")
    run.add_argument(
        "--input",
        action="append",
        type=_pair_arg,
        default=[],
        metavar="NAME=FILE.npy",
        help="value of an input tensor (repeatable)",
    )
    run.add_argument("--random", action="store_true", help="fill inputs not given with random normal values")
    run.add_argument("--seed", type=_seed_arg, default=0, help="seed for --random (0)")
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

    compile_help = "Compile an ONNX model or .nf program (optionally with a training step) into a build directory."
    comp = commands.add_parser("compile", help=compile_help, description=compile_help)
    comp.add_argument("model", help="an .onnx model or an .nf program")
    comp.add_argument("-o", "--output", default="build", metavar="DIR", help="build directory to write (build)")
    comp.add_argument(
        "--target",
        default="interp",
        help="interp (reference interpreter), cpu (C compiled with cc), cuda (CUDA compiled with NVRTC; "
        "runs on an NVIDIA GPU), tensorcore (the tensor-core model: cuda's kernels in numpy), npu or npu-split "
        "(the NPU model: programs, schedule, trace and counters written to the build), or npu:FILE.json (the NPU "
        "model of the machine that file describes; the build keeps a copy) (interp)",
    )
    comp.add_argument(
        "--precision",
        default=None,
        choices=("tf32", "fp16", "bf16", "fp32"),
        help="cuda and tensorcore: float32 contractions on the tensor cores in tf32, fp16 or bf16, "
        "or exact fp32 (tf32)",
    )
    comp.add_argument(
        "--shape", action="append", type=_shape_arg, default=[], metavar="NAME=D1,D2,...", help="input shape"
    )
    comp.add_argument(
        "--fusion",
        default="none",
        metavar="POLICY",
        help="fusion policy: none, elementwise, neoflow, chimera, or module:Class (none)",
    )
    _training_options(comp)
    comp.set_defaults(func=cmd_compile)

    fuse_help = (
        "Show a fusion policy's plan of a model: per kernel its ops, stored, recomputed and tile-buffered tensors, "
        "arithmetic, bytes, predicted and measured time; --compare runs several policies."
    )
    fuse = commands.add_parser("fuse", help=fuse_help, description=fuse_help)
    fuse.add_argument("model", nargs="?", default=None, help="an .onnx model or an .nf program")
    fuse.add_argument(
        "--corpus",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="instead of one model: every .onnx model of DIR (default: the repository's models/) and the CPU "
        "benchmark's architectures (with PyTorch); --target may list several targets",
    )
    fuse.add_argument("--no-architectures", action="store_true", help="with --corpus: the directory's models only")
    fuse.add_argument("--no-measure", action="store_true", help="with --corpus: predicted times only (no timing)")
    fuse.add_argument(
        "--policy",
        default="neoflow",
        help="none, elementwise, neoflow, chimera, optimal (the cheapest partition; needs scipy) or module:Class "
        "(neoflow)",
    )
    fuse.add_argument(
        "--compare",
        metavar="P1,P2,...",
        help="compare these policies (the first is the baseline): steps timed in interleaved rounds, medians with "
        "95%% intervals and a verdict per policy; with optimal, each one's predicted time over the optimum's",
    )
    fuse.add_argument("--report", metavar="FILE.md", help="also write the tables as markdown")
    fuse.add_argument("--plot", metavar="FILE.png", help="with --compare: bar charts of kernels, bytes and step time")
    fuse.add_argument(
        "--target",
        default="cpu",
        help="cpu, interp, tensorcore (policies compared by the tensor-core model's predicted GPU time), "
        "npu, npu-split or npu:FILE.json (by simulated NPU cycles) (cpu)",
    )
    fuse.add_argument("--repeats", type=int, default=5, help="timed runs per kernel and per step; medians (5)")
    fuse.add_argument(
        "--rounds",
        type=int,
        default=11,
        help="with --compare: rounds in which every policy runs a block of steps, taking turns (11)",
    )
    fuse.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="with --compare: keep timing rounds until this many seconds have passed (at least --rounds)",
    )
    fuse.add_argument(
        "--shape", action="append", type=_shape_arg, default=[], metavar="NAME=D1,D2,...", help="input shape"
    )
    _training_options(fuse)
    fuse.set_defaults(func=cmd_fuse)

    tune_help = (
        "Measure a model's kernels on this machine (cpu: lowering path, block sizes, structure; cuda: each "
        "tensor-core piece's instruction, tiles and splits) and keep the fastest for every later compile; "
        "prints each kernel's gain and the step before and after."
    )
    tune = commands.add_parser("tune", help=tune_help, description=tune_help)
    tune.add_argument("model", help="an .onnx model or an .nf program")
    tune.add_argument("--budget", type=float, default=600.0, metavar="SECONDS", help="time for the search (600)")
    tune.add_argument("--retune", action="store_true", help="measure kernels tuned before again")
    tune.add_argument(
        "--target",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu (C kernels: path, block sizes, structure) or cuda (each tensor-core piece's instruction, "
        "tiles and depth splits, timed on the GPU) (cpu)",
    )
    tune.add_argument(
        "--precision", default=None, choices=("tf32", "fp16", "bf16", "fp32"), help="cuda: contraction precision"
    )
    tune.add_argument("--fusion", default="neoflow", metavar="POLICY", help="the fusion policy compiles use (neoflow)")
    tune.add_argument(
        "--shape", action="append", type=_shape_arg, default=[], metavar="NAME=D1,D2,...", help="input shape"
    )
    tune.add_argument("--no-progress", action="store_true", help="no progress bar")
    _training_options(tune)
    tune.set_defaults(func=cmd_tune)

    train_help = (
        "Train a build directory made by 'neoflow compile --train' on a data set; write the trained ONNX model."
    )
    train = commands.add_parser("train", help=train_help, description=train_help)
    train.add_argument("build", help="build directory from 'neoflow compile --train'")
    train.add_argument("--data", required=True, help="'digits' (scikit-learn's 8x8 digits) or an .npz with x and y")
    train.add_argument("--epochs", type=int, default=10, help="epochs (10)")
    train.add_argument("--batch", type=int, default=None, help="batch size (default: the model's)")
    train.add_argument("--lr", type=float, default=None, help="learning rate (default: the compiled one)")
    train.add_argument("--seed", type=_seed_arg, default=0, help="seed for the split and shuffling (0)")
    train.add_argument("-o", "--output", default=None, metavar="FILE", help="trained model (BUILD/trained.onnx)")
    train.add_argument(
        "--checkpoint",
        action="store_true",
        help="save the model (parameters, optimizer state, step) back into BUILD after every epoch, atomically, "
        "so that a later 'neoflow train BUILD' goes on from there",
    )
    train.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="train data-parallel on N local worker processes started through torchrun's launcher (gloo for "
        "the cpu target, NCCL and one GPU each for cuda); --batch is then the global batch (default: the "
        "build's batch on each rank). Under torchrun itself neoflow joins the launch's process group",
    )
    train.add_argument(
        "--sync-bn",
        action="store_true",
        help="data-parallel: average BatchNorm's batch statistics across ranks (default: each rank's own, as DDP)",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(func=cmd_train)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except NeoflowError as err:
        _fail(f"neoflow: {err}")
        return 1
    except Exception as err:  # a bug: still one line unless debugging
        if os.environ.get("NEOFLOW_DEBUG"):
            raise
        _fail(f"neoflow: internal error: {type(err).__name__}: {err} (set NEOFLOW_DEBUG=1 for a traceback)")
        return 70


def _fail(line: str) -> None:
    """Print the one-line error; a data-parallel worker leaves it for its launcher instead (which
    prints it once, naming the rank) where ``neoflow train --nproc`` started it."""
    from neoflow.runtime.distributed import record_failure

    if not record_failure(line):
        print(line, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
