"""Mutation fuzzing of neoflow's front doors: ONNX models from ``models/`` mutated the ways a user's files
go wrong (and text-language programs, grammar-aware), each compiled and run; every outcome must be a
result or a one-line ``NeoflowError``.

    python -m tests.fuzz --minutes 10 [--seed 0] [--workers 2] [--target interp|cpu] [--train-share 0.3]

A share of the ONNX mutants (``--train-share``) is compiled with a training step (cross-entropy, SGD) and
trained one step, the rest run inference; ``--target cpu`` compiles them to C (slower: fewer mutants).
Each mutant runs in a worker process under a time limit (a hang is an outcome too); the run prints how
many mutants ran and their outcomes by kind, and every internal error (an exception that is not a
``NeoflowError``, or a ``NeoflowError`` of more than one line) with the mutation that made it.  The test
suite runs a CI-sized share of the same mutations in process (``tests/test_fuzz.py``).
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import random
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

MODELS = Path(__file__).resolve().parents[1] / "models"
#: the models mutated (small enough that the interpreter runs them in a moment)
SEEDS = ("mlp.onnx", "cnn.onnx", "capsule.onnx", "upsampler.onnx")
#: seconds a mutant may take to compile and run before it counts as a hang
TIME_LIMIT = 60.0

Mutation = Callable[[onnx.ModelProto, random.Random], "onnx.ModelProto | bytes"]


def _node(model: onnx.ModelProto, rng: random.Random) -> onnx.NodeProto | None:
    nodes = model.graph.node
    return nodes[rng.randrange(len(nodes))] if nodes else None


def flip_bytes(model: onnx.ModelProto, rng: random.Random) -> bytes:
    data = bytearray(model.SerializeToString())
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data)


def truncate(model: onnx.ModelProto, rng: random.Random) -> bytes:
    data = model.SerializeToString()
    return data[: rng.randrange(len(data))]


def odd_attribute(model: onnx.ModelProto, rng: random.Random) -> onnx.ModelProto:
    with_attributes = [n for n in model.graph.node if n.attribute]
    if not with_attributes:
        return model
    attribute = rng.choice(rng.choice(with_attributes).attribute)
    value = rng.choice([0, -1, -7, 2**40, 3])
    if attribute.type == onnx.AttributeProto.INT:
        attribute.i = value
    elif attribute.type == onnx.AttributeProto.INTS:
        if attribute.ints and rng.random() < 0.5:
            attribute.ints[rng.randrange(len(attribute.ints))] = value
        else:
            del attribute.ints[: rng.randrange(len(attribute.ints) + 1)]
    elif attribute.type == onnx.AttributeProto.FLOAT:
        attribute.f = rng.choice([float("nan"), float("inf"), -1.0, 0.0, 1e30])
    elif attribute.type == onnx.AttributeProto.STRING:
        attribute.s = rng.choice([b"", b"nonsense", b"\xff"])
    return model


def attribute_of_another_type(model: onnx.ModelProto, rng: random.Random) -> onnx.ModelProto:
    with_attributes = [n for n in model.graph.node if n.attribute]
    if not with_attributes:
        return model
    attribute = rng.choice(rng.choice(with_attributes).attribute)
    name = attribute.name
    replacement = rng.choice(
        [
            onnx.helper.make_attribute(name, 2.5),
            onnx.helper.make_attribute(name, "text"),
            onnx.helper.make_attribute(name, [1.5, 2.5]),
            onnx.helper.make_attribute(name, 3),
            onnx.helper.make_attribute(name, [1, 2, 3, 4, 5]),
        ]
    )
    attribute.CopyFrom(replacement)
    return model


def input_dims(model: onnx.ModelProto, rng: random.Random) -> onnx.ModelProto:
    initializers = {t.name for t in model.graph.initializer}
    inputs = [v for v in model.graph.input if v.name not in initializers]
    if not inputs:
        return model
    dims = rng.choice(inputs).type.tensor_type.shape.dim
    if not dims:
        return model
    dim = dims[rng.randrange(len(dims))]
    choice = rng.random()
    if choice < 0.6:
        dim.dim_value = rng.choice([0, 1, 2, 3, 5, 1000, 2**31])
    elif choice < 0.8:
        dim.dim_param = "N"
    else:
        del dims[rng.randrange(len(dims))]
    return model


def rename_input(model: onnx.ModelProto, rng: random.Random) -> onnx.ModelProto:
    node = _node(model, rng)
    if node is not None and node.input:
        node.input[rng.randrange(len(node.input))] = rng.choice(["nowhere", "", node.output[0] if node.output else ""])
    return model


def drop_initializer(model: onnx.ModelProto, rng: random.Random) -> onnx.ModelProto:
    if model.graph.initializer:
        del model.graph.initializer[rng.randrange(len(model.graph.initializer))]
    return model


def initializer_type(model: onnx.ModelProto, rng: random.Random) -> onnx.ModelProto:
    if model.graph.initializer:
        tensor = model.graph.initializer[rng.randrange(len(model.graph.initializer))]
        tensor.data_type = rng.choice([TensorProto.INT64, TensorProto.DOUBLE, TensorProto.FLOAT16, 99, 0, -3])
    return model


def initializer_dims(model: onnx.ModelProto, rng: random.Random) -> onnx.ModelProto:
    if model.graph.initializer:
        tensor = model.graph.initializer[rng.randrange(len(model.graph.initializer))]
        if tensor.dims and rng.random() < 0.7:
            tensor.dims[rng.randrange(len(tensor.dims))] = rng.choice([0, 1, 7, -2, 10**9])
        else:
            tensor.dims.append(rng.choice([1, 3]))
    return model


def op_type(model: onnx.ModelProto, rng: random.Random) -> onnx.ModelProto:
    node = _node(model, rng)
    if node is not None:
        others = sorted({n.op_type for n in model.graph.node})
        node.op_type = rng.choice([*others, "Relu", "Softmax", "MatMul", "Transpose", "Nope", ""])
    return model


def duplicate_output(model: onnx.ModelProto, rng: random.Random) -> onnx.ModelProto:
    if len(model.graph.node) >= 2:
        a, b = rng.sample(list(model.graph.node), 2)
        if a.output and b.output:
            b.output[0] = a.output[0]
    return model


def cycle(model: onnx.ModelProto, rng: random.Random) -> onnx.ModelProto:
    nodes = model.graph.node
    if len(nodes) >= 2:
        first, later = sorted(rng.sample(range(len(nodes)), 2))
        if nodes[first].input and nodes[later].output:
            nodes[first].input[0] = nodes[later].output[0]
    return model


def empty_graph(model: onnx.ModelProto, rng: random.Random) -> onnx.ModelProto:
    del model.graph.node[:]
    if rng.random() < 0.5:
        del model.graph.output[:]
    return model


def opset(model: onnx.ModelProto, rng: random.Random) -> onnx.ModelProto:
    if rng.random() < 0.5:
        del model.opset_import[:]
    else:
        for entry in model.opset_import:
            entry.version = rng.choice([1, 5, 99, 10**6])
    return model


def drop_output(model: onnx.ModelProto, rng: random.Random) -> onnx.ModelProto:
    if model.graph.output:
        output = model.graph.output[rng.randrange(len(model.graph.output))]
        output.name = rng.choice(["nowhere", model.graph.input[0].name if model.graph.input else "x"])
    return model


MUTATIONS: dict[str, Mutation] = {
    f.__name__: f
    for f in (
        flip_bytes,
        truncate,
        odd_attribute,
        attribute_of_another_type,
        input_dims,
        rename_input,
        drop_initializer,
        initializer_type,
        initializer_dims,
        op_type,
        duplicate_output,
        cycle,
        empty_graph,
        opset,
        drop_output,
    )
}


#: text-language programs mutated (small shapes: the interpreter evaluates them at once)
PROGRAMS = (
    "X = tensor([2, 3, 6, 6])\nW = tensor([4, 3, 3, 3])\n"
    "Y[n, k, p, q] = ReduceAdd({c, r, s}, Select(p + r - 1 >= 0 && p + r - 1 < 6 && q + s - 1 >= 0 && "
    "q + s - 1 < 6, X[n, c, p + r - 1, q + s - 1], 0) * W[k, c, r, s])\n"
    "Z[n, k, h, w] = max(Y[n, k, h//2, w//2] * 0.5, 0)",
    "A = tensor([3, 7])\nS[i, j] = exp(A[i, j] - ReduceMax({m}, A[i, m])) / ReduceAdd({k}, exp(A[i, k] - "
    "ReduceMax({l}, A[i, l])))",
    "In = tensor([2, 2, 5, 5, 2, 2])\nW = tensor([2, 2, 3, 3, 2, 2])\n"
    "Out[b, k, p, q, i, j] = ReduceAdd({c, r, s, t}, In[b, c, p + r, q + s, i, t] * W[k, c, r, s, t, j])",
)
#: what a text mutation may put in: brackets, operators, names, numbers, functions
TEXT_PIECES = (
    "[",
    "]",
    "(",
    ")",
    "{",
    "}",
    ",",
    "//",
    "%",
    "/ 0",
    "//0",
    " + ",
    "*",
    "-",
    "1e300",
    "-7",
    "99",
    "Y",
    "Z",
    "S",
    "nosuch",
    "foo(",
    "ReduceAdd(",
    "Select(",
    "exp(",
    "tensor([",
    "|",
    "&&",
    "==",
    ":",
    "=",
)


def text_mutant(program: int, seed: int) -> str:
    """Program ``program`` of ``PROGRAMS`` with a few grammar-aware edits: a character dropped, a
    piece of the language put in, a number changed, a name made to read itself."""
    rng = random.Random(seed)
    text = PROGRAMS[program]
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(text))
        choice = rng.random()
        if choice < 0.3:
            text = text[:at] + text[at + 1 :]
        elif choice < 0.7:
            text = text[:at] + rng.choice(TEXT_PIECES) + text[at:]
        elif choice < 0.85:
            digits = [k for k, ch in enumerate(text) if ch.isdigit()]
            if digits:
                k = rng.choice(digits)
                text = text[:k] + str(rng.choice([0, 1, 9, 100])) + text[k + 1 :]
        else:  # an op reading itself or a later op
            lines = text.splitlines()
            last = lines[-1]
            name = last.split("[", 1)[0]
            lines[-1] = last.replace("ReduceAdd(", f"{name}[0, 0] + ReduceAdd(", 1) if "ReduceAdd(" in last else last
            text = "\n".join(lines)
    return text


def text_outcome(text: str) -> tuple[str, str]:
    """Parse ``text`` and evaluate it on random inputs: ``ok``, ``neoflow error`` or ``internal``."""
    import neoflow

    def run() -> None:
        graph = neoflow.graph(text)
        rng = np.random.default_rng(0)
        neoflow.evaluate(graph, {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in graph.inputs})

    return _classified(run)


def _classified(run: Callable[[], object]) -> tuple[str, str]:
    """``("ok", "")`` where ``run()`` returns, ``("neoflow error", message)`` where it raises a one-line
    ``NeoflowError``, else ``("internal", what and where)``."""
    from neoflow.errors import NeoflowError

    try:
        run()
    except NeoflowError as err:
        message = str(err)
        if "\n" in message or not message:
            return "internal", f"NeoflowError of {message.count(chr(10)) + 1} lines: {message[:300]!r}"
        return "neoflow error", message
    except Exception as err:  # what the fuzzer is for: anything else is a bug
        frames = traceback.extract_tb(err.__traceback__)
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-4:]))
        return "internal", f"{type(err).__name__}: {str(err)[:200]} at {where}"
    return "ok", ""


def mutant(seed_model: str, mutation: str, seed: int) -> bytes:
    """The bytes of ``seed_model`` mutated by ``mutation`` with random ``seed`` (twice, sometimes)."""
    rng = random.Random(seed)
    model = onnx.load(MODELS / seed_model)
    result = MUTATIONS[mutation](model, rng)
    if isinstance(result, onnx.ModelProto) and rng.random() < 0.2:
        result = MUTATIONS[rng.choice(sorted(MUTATIONS))](result, rng)
    return result if isinstance(result, bytes) else result.SerializeToString()


def outcome(data: bytes, workdir: Path, target: str = "interp", train: bool = False) -> tuple[str, str]:
    """Compile the model ``data`` for ``target`` (with ``train``, a training step) and run it (train one
    step) on random inputs: ``("ok", "")``, ``("neoflow error", message)`` or ``("internal", traceback
    summary)``."""
    import neoflow

    path = workdir / "mutant.onnx"
    path.write_bytes(data)

    def run() -> None:
        if train:
            model = neoflow.compile(path, target=target, train=neoflow.TrainSpec(labels="fuzz_labels"))
            model.train_step(model.example_batch(training=True), check=True)
        else:
            model = neoflow.compile(path, target=target)
            model.run(model.example_batch())

    return _classified(run)


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout


def within(run: Callable[[], tuple[str, str]], seconds: float = TIME_LIMIT) -> tuple[str, str]:
    """``run()``'s outcome under a time limit (``hang`` past it; SIGALRM, so in the main thread only)."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return run()
    except _Timeout:
        return "hang", f"over {seconds:.0f} s"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def outcome_within(
    data: bytes, workdir: Path, seconds: float = TIME_LIMIT, target: str = "interp", train: bool = False
) -> tuple[str, str]:
    """``outcome`` under a time limit."""
    return within(lambda: outcome(data, workdir, target, train), seconds)


def _work(job: tuple[str, str, int, str, str, bool]) -> tuple[str, str, int, str, str]:
    seed_model, mutation, seed, workdir, target, train = job
    np.random.seed(seed)
    if mutation == "text":
        kind, detail = within(lambda: text_outcome(text_mutant(int(seed_model), seed)))
        return f"program {seed_model}", mutation, seed, kind, detail
    try:
        data = mutant(seed_model, mutation, seed)
    except Exception as err:  # a mutation onnx itself refuses to serialise: not neoflow's to judge
        return seed_model, mutation, seed, "skipped", f"{type(err).__name__}"
    kind, detail = outcome_within(data, Path(workdir), target=target, train=train)
    return seed_model, f"{mutation} (train)" if train else mutation, seed, kind, detail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--target", choices=("interp", "cpu"), default="interp")
    parser.add_argument("--train-share", type=float, default=0.3, help="share of ONNX mutants trained a step")
    args = parser.parse_args(argv)
    import tempfile

    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.minutes * 60
    counts: collections.Counter = collections.Counter()
    by_mutation: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    internal: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="neoflow-fuzz-"))
    context = multiprocessing.get_context("fork")
    with context.Pool(args.workers, maxtasksperchild=20) as pool:
        pending = []
        k = 0
        while time.monotonic() < deadline or pending:
            while time.monotonic() < deadline and len(pending) < 2 * args.workers:
                workdir = str(root / f"w{k}")
                if rng.random() < 0.25:  # a text-language program
                    job = (str(rng.randrange(len(PROGRAMS))), "text", rng.randrange(2**31), workdir, "interp", False)
                else:
                    mutation, train = rng.choice(sorted(MUTATIONS)), rng.random() < args.train_share
                    job = (rng.choice(SEEDS), mutation, rng.randrange(2**31), workdir, args.target, train)
                Path(job[3]).mkdir()
                pending.append(pool.apply_async(_work, (job,)))
                k += 1
            done = [p for p in pending if p.ready()]
            if not done:
                time.sleep(0.05)
                continue
            for p in done:
                pending.remove(p)
                seed_model, mutation, seed, kind, detail = p.get()
                counts[kind] += 1
                by_mutation[mutation][kind] += 1
                if kind in ("internal", "hang"):
                    internal.append(f"{seed_model} {mutation} seed {seed}: {kind}: {detail}")
    total = sum(counts.values())
    print(f"target {args.target}, {args.train_share:.0%} of ONNX mutants trained a step")
    print(f"{total} mutants in {args.minutes:g} min: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for mutation, found in sorted(by_mutation.items()):
        print(f"  {mutation}: " + ", ".join(f"{k} {v}" for k, v in sorted(found.items())))
    for line in internal:
        print("  " + line)
    return 1 if internal else 0


if __name__ == "__main__":
    raise SystemExit(main())
