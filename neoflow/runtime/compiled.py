"""Compiled models: ``neoflow.compile`` → ``CompiledModel`` with run / train_step / save / export_onnx."""

from __future__ import annotations

import dataclasses
import os
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from neoflow.autodiff.training import (
    TrainingGraph,
    TrainSpec,
    build_training_graph,
    checked_learning_rate,
    internal_names,
)
from neoflow.errors import CompileError, InputError, NumericError
from neoflow.frontend import load_onnx, read_model
from neoflow.fusion.policies import FusionPolicy, load_policy
from neoflow.ir import dtypes as dt
from neoflow.ir.graph import Graph
from neoflow.ir.interpreter import input_array, require_mapping
from neoflow.ir.op import Op, Tensor
from neoflow.ir.printer import print_graph
from neoflow.ir.text import parse_graph
from neoflow.runtime import compile_cache
from neoflow.runtime.build_dir import MANIFEST, Build, open_build, save_build
from neoflow.runtime.custom_op import CompiledOp
from neoflow.runtime.fusing import DEFAULT_POLICY, build_executor
from neoflow.runtime.report import compile_report
from neoflow.runtime.resources import check_memory
from neoflow.targets import check_target, machine_file, with_machine_file
from neoflow.targets.cache import write_atomically

ModelSource = str | os.PathLike | onnx.ModelProto | Graph
#: the copy of a ``<target>:<file>`` target's machine description a build directory keeps
MACHINE_FILE = "machine.json"
BUILD_FORMAT = "neoflow-build/2"
#: the formats ``load`` reads (``/1``: written before builds listed their files' digests; not verified)
READABLE_FORMATS = ("neoflow-build/1", BUILD_FORMAT)


def compile(
    model: ModelSource | Op,
    target: str = "interp",
    train: TrainSpec | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    parameters: Mapping[str, np.ndarray] | None = None,
    grad: bool = False,
    fusion: str | FusionPolicy = DEFAULT_POLICY,
    precision: str | None = None,
) -> CompiledModel | CompiledOp:
    """Compile an ONNX model (path or ModelProto), a ``.nf`` program, a ``Graph``
    or a single ``Op``.

    ``train`` adds a training step (loss, reverse pass, optimizer update);
    ``shapes`` binds input shapes by name; ``parameters`` gives values to graph
    inputs, which then become parameters (trainable unless frozen).  Returns a
    ``CompiledModel``; for an ``Op``, a ``CompiledOp`` (with ``grad=True`` its
    adjoints too: ``.run(inputs)``, ``.backward(inputs, {"dOut": ...})``).
    ``fusion`` is the fusion policy: a built-in name (``none``, ``elementwise``,
    ``neoflow``, ``chimera``), ``module:Class`` or a policy object.
    ``precision`` (``cuda`` and ``tensorcore``) is how float32 contractions use the tensor
    cores: ``tf32`` (the default), ``fp16``, ``bf16`` (operands rounded, fp32 accumulation) or
    ``fp32`` (exact, on SIMT cores).
    Errors are ``neoflow`` errors with one-line messages."""
    check_target(target)
    if isinstance(model, Op):
        return CompiledOp(model, target, grad, fusion, precision)
    if not isinstance(model, Graph) and not _is_program(model):
        model = read_model(model)  # read and checked once: the cache key and the compile take this proto
    name = _cache_key(model, target, train, shapes, parameters, fusion, precision)
    if name is not None:
        found = compile_cache.lookup(name)
        if isinstance(found, CompiledModel):
            found.from_cache = True
            return found
    compiled = _compile_model(model, target, train, shapes, parameters, fusion, precision)
    if name is not None:
        compile_cache.store(name, compiled)
    return compiled


def _cache_key(model, target, train, shapes, parameters, fusion, precision) -> str | None:
    """The compile cache's key for these arguments; None where the compile is not cached (a graph
    object, parameters given as arrays, a policy object, a target whose executors are not known to reload
    — the cuda one holds paths into NVRTC's cache and a GPU context — or the cache turned off)."""
    if target not in compile_cache.TARGETS or not compile_cache.enabled():
        return None
    if parameters or not isinstance(fusion, str) or isinstance(model, Graph):
        return None
    if _is_program(model):
        path = Path(model)
        if not path.is_file():
            return None  # the compile itself reports it
        data = path.read_bytes()
    else:
        data = model.SerializeToString(deterministic=True)
    options = repr((target, train, sorted((k, tuple(v)) for k, v in (shapes or {}).items()), fusion, precision))
    if target == "cpu":  # its kernels as ``neoflow tune`` left them
        options += _cpu_tuning()
    return compile_cache.key(data, options)


def _cpu_tuning() -> str:
    from neoflow.targets.cpu.executor import threads
    from neoflow.targets.cpu.tuning import table_digest

    return table_digest(threads())


def _is_program(model: object) -> bool:
    """Whether ``model`` names a ``.nf`` program file."""
    return isinstance(model, (str, os.PathLike)) and os.fspath(model).endswith(".nf")


def _compile_model(model, target, train, shapes, parameters, fusion, precision) -> CompiledModel:
    """The compile itself, of a ``Graph``, a ``.nf`` path or a checked ``ModelProto``."""
    proto = None
    if isinstance(model, Graph):
        inference = model
    elif _is_program(model):
        path = Path(model)
        if not path.is_file():
            raise InputError(f"no such file: '{path}'")
        inference = parse_graph(path.read_text(), shapes)
    else:
        proto = model
        # trained, a weight read through a computation (a Linear's Transpose) must stay the weight
        inference = load_onnx(proto, shapes, fold_parameters=train is None)
    if parameters:
        inference = _bind(inference, parameters)
    check_memory(inference)
    forward = inference
    if train is not None and proto is not None:
        forward = dataclasses.replace(
            load_onnx(proto, shapes, training=True, fold_parameters=False), parameters=inference.parameters
        )
    training = None
    if train is not None:
        constants: list[str] = []
        if proto is not None:  # a value the import computed (a folded Pow of two constants) is not trained
            sources = {internal: source for source, internal in internal_names(forward).items()}
            stored = _parameter_sources(proto) | set(parameters or {})
            constants = [p for p in forward.parameters if sources.get(p, p) not in stored]
        training = build_training_graph(forward, train, constants)
        check_memory(training.graph)
    return CompiledModel(inference, training, train, target, proto, dict(shapes or {}), fusion, precision)


def _parameter_sources(proto: onnx.ModelProto) -> set[str]:
    """The ONNX names of a model's parameters: its initializers, and the outputs of ``Identity``
    nodes reading one (PyTorch's exporter keeps one initializer of several equal parameters, as four
    LayerNorms' fresh weights of ones, and the others as ``Identity`` copies: each is trained as the
    parameter it was in the model)."""
    found = {t.name for t in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type == "Identity" and node.input and node.input[0] in found:
            found.add(node.output[0])
    return found


def _random(rng: np.random.Generator, shape: Sequence[int], dtype: str, classes: int) -> np.ndarray:
    """Standard normal floats, or integers in ``[0, classes)``."""
    if dtype.startswith("float"):
        return rng.standard_normal(shape).astype(dt.numpy_dtype(dtype))
    return rng.integers(0, classes, size=shape).astype(dt.numpy_dtype(dtype))


def _bind(graph: Graph, parameters: Mapping[str, np.ndarray]) -> Graph:
    """``graph`` with the given inputs turned into parameters."""
    table = internal_names(graph)
    inputs = {t.name: t for t in graph.inputs}
    bound = dict(graph.parameters)
    for name, value in parameters.items():
        internal = table.get(name)
        if internal not in inputs:
            raise InputError(f"parameter '{name}' is not an input of the model")
        array = np.asarray(value)
        if array.shape != inputs[internal].shape:
            raise InputError(
                f"parameter '{name}' has shape {list(array.shape)}, expected {list(inputs[internal].shape)}"
            )
        bound[internal] = array.astype(dt.numpy_dtype(inputs[internal].dtype))
    return dataclasses.replace(graph, parameters=bound)


class CompiledModel:
    """A model compiled for one target: inference, and a training step when
    compiled with a ``TrainSpec``.  Tensors are named as in the model file."""

    def __init__(
        self,
        inference: Graph,
        training: TrainingGraph | None,
        spec: TrainSpec | None,
        target: str,
        source: onnx.ModelProto | None,
        shapes: dict[str, Sequence[int]],
        fusion: str | FusionPolicy = DEFAULT_POLICY,
        precision: str | None = None,
    ) -> None:
        self.target = target
        self.precision = precision
        self.fusion = load_policy(fusion)
        kind = type(self.fusion)
        self.fusion_name = fusion if isinstance(fusion, str) else f"{kind.__module__}:{kind.__qualname__}"
        self.spec = spec
        self.training = training
        self.inference = inference
        self.source = source
        self.shapes = shapes
        self.step = 0
        self.lr = spec.lr if spec is not None else 0.0
        self.last_prediction: np.ndarray | None = None
        # a training compile builds the inference executor when it is first used: the step's own covers
        # the same forward ops (and fails on them alike), and planning and compiling both doubled the wait
        self._inference_built = None if training is not None else self._build_inference()
        self._names = {name: source for source, name in internal_names(inference).items()}
        if source is not None:
            initializers = _parameter_sources(source)
            self._parameter_names = [p for p in inference.parameters if self._names[p] in initializers]
        else:
            self._parameter_names = list(inference.parameters)
        self._values = {p: np.array(inference.parameters[p]) for p in self._parameter_names}
        self._train = self._gradients = None
        self._input_tables: dict[tuple[int, tuple[str, ...]], dict[str, Tensor]] = {}
        self.from_cache = False  # loaded from the compile cache (``runtime.compile_cache``)
        if training is not None:
            self._values.update({name: np.array(v) for name, v in training.state.items()})
            keep = [training.loss, *training.updates.values()]
            if spec.keep_prediction:
                keep.insert(1, training.prediction)
            self._train = build_executor(target, training.graph, keep, self.fusion, precision)

    def __getstate__(self) -> dict:
        """What the compile cache stores: the input tables are keyed by the graphs' ids (rebuilt), and a
        current value equal to the graphs' own (every one, fresh from a compile) is not stored twice."""
        sources = self._value_sources()
        shared = [
            name
            for name, value in self._values.items()
            if name in sources and sources[name].shape == value.shape and np.array_equal(sources[name], value)
        ]
        values = {name: value for name, value in self._values.items() if name not in shared}
        return {**self.__dict__, "_input_tables": {}, "_values": values, "_shared_values": shared}

    def __setstate__(self, state: dict) -> None:
        shared = state.pop("_shared_values", [])
        self.__dict__.update(state)
        sources = self._value_sources()
        self._values.update({name: np.array(sources[name]) for name in shared})

    def _value_sources(self) -> dict[str, np.ndarray]:
        """The graphs' own values of parameters and optimizer state, by internal name."""
        training = {} if self.training is None else self.training.graph.parameters
        return {**self.inference.parameters, **training}

    def _build_inference(self):
        return build_executor(self.target, self.inference, self.inference.outputs, self.fusion, self.precision)

    @property
    def _run(self):
        """The inference graph's executor, built on first use."""
        if self._inference_built is None:
            self._inference_built = self._build_inference()
        return self._inference_built

    # ----------------------------------------------------------------- running

    @property
    def inference_executor(self):
        """The target's executor of the inference graph (its ``describe`` lists kernels where it has one)."""
        return self._run

    @property
    def lr(self) -> float:
        """The learning rate the next training steps use (settable)."""
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._lr = checked_learning_rate(value)

    def public_name(self, name: str) -> str:
        """The name a tensor has in the model file (its graph name for text models)."""
        return self._names.get(name, name)

    def _feed(self, graph: Graph, given: Mapping[str, np.ndarray], extra: Mapping[str, np.ndarray]) -> dict:
        """Every input of ``graph``: the caller's (checked), parameters, state, ``extra``."""
        require_mapping(given, "inputs")
        table = self._input_table(graph, tuple(extra))
        unknown = sorted(set(given) - set(table))
        if unknown:
            raise InputError(f"'{unknown[0]}' is not an input of the model (inputs: {', '.join(table)})")
        values = {**graph.parameters, **self._values, **extra}
        for source, tensor in table.items():
            if source not in given:
                raise InputError(f"missing input '{source}' (expected shape {list(tensor.shape)}, {tensor.dtype})")
            values[tensor.name] = input_array(given[source], tensor, f"input '{source}'")
        return values

    def _input_table(self, graph: Graph, extra: tuple[str, ...]) -> dict[str, Tensor]:
        """The inputs of ``graph`` a caller gives, by public name: neither parameters,
        state nor ``extra`` (worked out once per graph: every step asks)."""
        key = (id(graph), extra)
        table = self._input_tables.get(key)
        if table is None:
            table = {self.public_name(t.name): t for t in graph.free_inputs if t.name not in extra}
            table = {k: t for k, t in table.items() if t.name not in self._values}
            self._input_tables[key] = table
        return table

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Inference with the current parameters: outputs by name."""
        outputs = self._run.run(self._feed(self.inference, inputs, {}))
        return {self.public_name(name): value for name, value in outputs.items()}

    def _training_feed(self, batch: Mapping[str, np.ndarray]) -> dict:
        training = self._require_training()
        require_mapping(batch, "a batch")
        batch = dict(batch)
        if training.labels is not None:
            batch[self.spec.labels] = self._check_labels(training, batch)
        extra = {}
        if training.noise:  # a generator costs as much as a small model's step: only for dropout
            noise = np.random.default_rng((self.spec.seed, self.step))
            tensors = training.graph.tensors
            extra = {name: noise.random(tensors[name].shape, np.float32) for name in training.noise}
        extra[training.learning_rate] = np.float32(self.lr)
        return self._feed(training.graph, batch, extra)

    def _check_labels(self, training: TrainingGraph, batch: Mapping[str, np.ndarray]) -> np.ndarray:
        labels: Tensor = training.labels
        name = self.spec.labels
        if name not in batch:
            raise InputError(f"missing labels '{name}' (expected shape {list(labels.shape)}, {labels.dtype})")
        array = np.asarray(batch[name])
        if array.shape != labels.shape:
            raise InputError(f"labels '{name}' have shape {list(array.shape)}, expected {list(labels.shape)}")
        if labels.dtype == "int64":
            if not np.issubdtype(array.dtype, np.integer):
                raise InputError(f"labels '{name}' must be integer class indices, got {array.dtype}")
            classes = training.graph.op(training.prediction).shape[1]
            if array.size and (array.min() < 0 or array.max() >= classes):
                bad = array[(array < 0) | (array >= classes)][0]
                raise InputError(f"label {bad} in '{name}' is outside [0, {classes})")
        return array

    def train_step(self, batch: Mapping[str, np.ndarray], check: bool = False) -> float:
        """One optimizer step on ``batch`` (data inputs and labels by name);
        returns the loss before the step.  With ``check``, a loss or an updated parameter
        that is not finite (a NaN or Inf gradient makes its parameter so) raises
        ``NumericError`` with the step's number, and the parameters stay as they were."""
        training = self._require_training()
        # the next values are read by the next step only, so the executor may write the
        # step after next's into the same buffers (what it returns is not kept longer)
        outputs = self._train.run(self._training_feed(batch), recycle=True)
        if check:
            self._check_finite(training, outputs)
        for target, next_value in training.updates.items():
            self._values[target] = outputs[next_value]
        self.step += 1
        prediction = outputs.get(training.prediction)
        self.last_prediction = None if prediction is None else prediction.copy()
        return float(outputs[training.loss])

    def _check_finite(self, training: TrainingGraph, outputs: Mapping[str, np.ndarray]) -> None:
        """Raise ``NumericError`` where the step's loss or an updated value is NaN or Inf."""
        number = self.step + 1
        loss = float(outputs[training.loss])
        if not np.isfinite(loss):
            raise NumericError(f"training step {number}: the loss is {loss}")
        for target, next_value in training.updates.items():
            value = outputs[next_value]
            if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
                bad = int(np.size(value) - np.isfinite(value).sum())
                raise NumericError(
                    f"training step {number}: the update of '{self.public_name(target)}' holds {bad} NaN or Inf "
                    f"value(s) of {value.size} (its gradient is not finite); the parameters are left as they were"
                )

    def gradients(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The loss gradient of every trainable parameter on ``batch``, by name
        (the parameters are not changed)."""
        training = self._require_training()
        if self._gradients is None:  # built on first use: most models never ask
            keep = [training.loss, *training.gradients.values()]
            self._gradients = build_executor(self.target, training.graph, keep, self.fusion, self.precision)
        outputs = self._gradients.run(self._training_feed(batch))
        return {self.public_name(p): outputs[g] for p, g in training.gradients.items()}

    def example_batch(self, training: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
        """Random values for every input ``run`` (or, with ``training``,
        ``train_step``: labels included) needs, by name: what timing a step takes."""
        rng = np.random.default_rng(seed)
        step = self._require_training() if training else None
        if step is not None:
            tensors = list(step.data_inputs)
        else:
            tensors = [t for t in self.inference.free_inputs if t.name not in self._values]
        # integer data inputs (indices, masks) get 0 or 1: in range for any tensor they index
        batch = {self.public_name(t.name): _random(rng, t.shape, t.dtype, 2) for t in tensors}
        if step is not None and step.labels is not None:
            classes = step.graph.tensors[step.prediction].shape[-1]
            batch[self.spec.labels] = _random(rng, step.labels.shape, step.labels.dtype, classes)
        return batch

    def executor_and_feed(self, batch: Mapping[str, np.ndarray], training: bool = False) -> tuple[object, dict]:
        """The executor of inference (or of the training step) and its full feed
        for ``batch`` (parameters and state included): for profiling its kernels."""
        if training:
            return self._train, self._training_feed(batch)
        return self._run, self._feed(self.inference, batch, {})

    def _require_training(self) -> TrainingGraph:
        if self.training is None:
            raise CompileError("the model was compiled for inference; compile with train=neoflow.TrainSpec(...)")
        return self.training

    # -------------------------------------------------------------- parameters

    def parameters(self) -> dict[str, np.ndarray]:
        """The model's parameters (trained values), by name, as copies."""
        return {self.public_name(p): self._values[p].copy() for p in self._parameter_names}

    def set_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        """Replace some parameters' values (by name); shapes must match."""
        table = {self.public_name(p): p for p in self._parameter_names}
        for name, value in values.items():
            if name not in table:
                raise InputError(f"parameter '{name}' does not exist (the model has: {', '.join(sorted(table))})")
            tensor = self.inference.tensors[table[name]]
            self._values[table[name]] = input_array(value, tensor, f"parameter '{name}'").copy()

    def restore_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Set optimizer state tensors (as ``save`` wrote them); unknown names and
        shape mismatches (a recompiled model) are skipped."""
        if self.training is None:
            return
        for name in self.training.state:
            if name in state and np.shape(state[name]) == self._values[name].shape:
                self._values[name] = np.asarray(state[name], np.float32)

    @property
    def memory(self) -> dict[str, object]:
        """The memory plans: ``"inference"`` and (when training) ``"training"``."""
        plans = {"inference": self._run.plan}
        if self._train is not None:
            plans["training"] = self._train.plan
        return plans

    def report(self) -> str:
        """The compile report: ops, loss, optimizer, parameters, saved activations, memory."""
        return compile_report(self)

    # ------------------------------------------------------------------ files

    def export_onnx(self, path: str | os.PathLike) -> Path:
        """Write the source ONNX model with the current parameter values as its
        initializers (runs in any ONNX runtime); returns the path."""
        if self.source is None:
            raise CompileError("export_onnx needs a model imported from ONNX (this one was built from text)")
        model = onnx.ModelProto()
        model.CopyFrom(self.source)
        values = {self.public_name(p): self._values[p] for p in self._parameter_names}
        for k, tensor in enumerate(model.graph.initializer):
            if tensor.name in values:
                old = numpy_helper.to_array(tensor)
                new = numpy_helper.from_array(values[tensor.name].astype(old.dtype), tensor.name)
                model.graph.initializer[k].CopyFrom(new)
        # a parameter the exporter kept as an Identity copy of another becomes its own initializer again
        copies = [n for n in model.graph.node if n.op_type == "Identity" and n.output[0] in values]
        for node in copies:
            model.graph.node.remove(node)
            model.graph.initializer.append(numpy_helper.from_array(values[node.output[0]], node.output[0]))
        target = Path(path)
        _write_atomically(target, model.SerializeToString())
        return target

    def save(self, directory: str | os.PathLike) -> Path:
        """Write everything ``neoflow.load`` needs into ``directory``: the model
        with its current parameters, the optimizer state, the training step
        (text), a report and a manifest listing each file's size and SHA-256.
        Atomic: a save interrupted at any point leaves the previous one loadable."""
        directory = Path(directory)
        save_build(directory, self._write_build)
        return directory

    def _write_build(self, staging: Path) -> dict:
        """Write the build's files into ``staging``; its manifest."""
        manifest = {
            "format": BUILD_FORMAT,
            "target": self.target,
            "shapes": {k: list(v) for k, v in self.shapes.items()},
            "train": None if self.spec is None else dataclasses.asdict(self.spec),
            "step": self.step,
            "lr": self.lr,
            "fusion": self.fusion_name,
            "precision": self.precision,
        }
        if self.source is not None:
            self.export_onnx(staging / "model.onnx")
            manifest["model"] = "model.onnx"
        else:
            (staging / "model.nf").write_text(print_graph(self.inference) + "\n")
            np.savez(staging / "parameters.npz", **{p: self._values[p] for p in self._parameter_names})
            manifest["model"] = "model.nf"
        if self.training is not None:
            np.savez(staging / "state.npz", **{k: self._values[k] for k in self.training.state})
            (staging / "train_step.nf").write_text(print_graph(self.training.graph) + "\n")
        for role, executor in (("inference", self._run), ("train_step", self._train)):
            # what the target built (C and its library, CUDA and its cubin), by file suffix
            for suffix, data in getattr(executor, "artifacts", dict)().items():
                (staging / f"{role}{suffix}").write_bytes(data)
        described = machine_file(self.target)
        if described is not None:  # the build keeps its own copy of the machine it was compiled for
            (staging / MACHINE_FILE).write_bytes(Path(described).read_bytes())
            manifest["target"] = with_machine_file(self.target, MACHINE_FILE)
        (staging / "report.txt").write_text(self.report() + "\n")
        return manifest


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, so a failure leaves no half-written file."""
    try:
        write_atomically(path, data)
    except OSError as err:
        raise InputError(f"cannot write '{path}': {err.strerror or err}") from None


def load(directory: str | os.PathLike, target: str | None = None, shapes: Mapping[str, Sequence[int]] | None = None):
    """Load a model ``CompiledModel.save`` wrote (recompiling it for ``target``,
    default the saved one, with the saved input shapes, those named in ``shapes``
    replaced); every file is
    checked against the manifest's SHA-256 and the saved tensors' shapes against
    the model's (an ``InputError`` naming the damaged file)."""
    build = open_build(Path(directory))
    manifest = build.manifest
    manifest_path = build.path(MANIFEST)
    try:
        if manifest.get("format") not in READABLE_FORMATS:
            raise ValueError(f"format {manifest.get('format')!r}")
        spec = None
        if manifest["train"] is not None:
            spec = TrainSpec(
                **{
                    **manifest["train"],
                    "betas": tuple(manifest["train"]["betas"]),
                    "frozen": tuple(manifest["train"]["frozen"]),
                }
            )
        model_path = build.path(manifest["model"])
        saved_target = manifest["target"]
        saved_shapes = dict(manifest["shapes"])
        step, lr = int(manifest.get("step", 0)), manifest.get("lr")
    except (ValueError, KeyError, TypeError) as err:
        raise InputError(f"'{manifest_path}' is not a valid neoflow manifest ({err})") from None
    parameters = _saved_arrays(build, "parameters.npz") if model_path.suffix == ".nf" else None
    described = machine_file(saved_target)
    if described is not None and not Path(described).is_absolute():  # the build's own copy of its machine
        saved_target = with_machine_file(saved_target, build.path(described))
    compiled = compile(
        model_path,
        target or saved_target,
        spec,
        {**saved_shapes, **(shapes or {})},
        parameters,
        fusion=manifest.get("fusion", DEFAULT_POLICY),
        precision=manifest.get("precision"),
    )
    if compiled.training is not None and build.has("state.npz"):
        state = _saved_arrays(build, "state.npz")
        for name in compiled.training.state:
            expected = compiled._values[name].shape
            if name not in state or state[name].shape != expected:
                found = "missing" if name not in state else f"of shape {list(state[name].shape)}"
                raise InputError(
                    f"'{build.path('state.npz')}' does not fit the model: optimizer state '{name}' is {found}, "
                    f"expected shape {list(expected)}"
                )
        compiled.restore_state(state)
    compiled.step = step
    compiled.lr = float(lr) if lr is not None else compiled.lr
    return compiled


def _saved_arrays(build: Build, name: str) -> dict[str, np.ndarray]:
    """The arrays of the build's ``.npz`` file ``name`` (an ``InputError`` where it cannot be read)."""
    path = build.path(name)
    try:
        with np.load(path, allow_pickle=False) as saved:
            return {k: saved[k] for k in saved.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
        raise InputError(f"'{path}' cannot be read as saved arrays ({type(err).__name__}: {err})") from None
