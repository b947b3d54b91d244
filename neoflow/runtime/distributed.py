"""Data-parallel training of a compiled step on ``torch.distributed`` (gloo on CPUs, NCCL on GPUs).

Each rank runs the training step on its shard of the global batch.  The step is split where the
reverse pass completes a *bucket* of gradients (the reverse pass's order is known at compile
time): each piece is compiled as its own executor, and after it the bucket's all-reduce (mean) is
started without waiting, so communication overlaps the rest of the backward pass; the optimizer
update runs after every bucket has arrived.  With ``sync_bn`` a BatchNorm's batch mean and variance
(and, in the reverse pass, their adjoints) are averaged across ranks where they are computed, so
the step normalises with the global batch's statistics.  ``split_step`` is the split (no torch);
``DataParallel`` runs it; ``join`` joins the process group a ``torchrun`` launch describes and
``launch`` starts N local workers through the same launcher.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from neoflow.autodiff.training import TrainingGraph
from neoflow.errors import CompileError, InputError, NeoflowError
from neoflow.ir import dtypes as dt
from neoflow.ir.graph import Graph
from neoflow.ir.op import Op
from neoflow.runtime.compiled import CompiledModel
from neoflow.runtime.fusing import build_executor
from neoflow.targets.memory import nbytes

#: DDP's default bucket cap; a model whose gradients are smaller is split into ``MIN_BUCKETS``
BUCKET_CAP_BYTES = 25 << 20
MIN_BUCKETS = 4
#: the smallest bucket worth a collective of its own
MIN_BUCKET_BYTES = 64 << 10
#: parameters are compared across ranks every this many steps
CHECK_EVERY = 100
#: set in the environment of the workers ``launch`` starts (their errors are printed by it)
LAUNCHED_BY = "NEOFLOW_LAUNCHED"
#: the targets whose tensors live on a GPU (reduced by NCCL); the others' live in host memory (gloo)
DEVICE_TARGETS = ("cuda",)


class DistributedError(NeoflowError):
    """The ranks of a data-parallel run disagree, or one of them failed."""

    kind = "distributed error"


# --------------------------------------------------------------------------- the split


@dataclass(frozen=True)
class Segment:
    """A piece of the training step: its ``ops`` (in order), the tensors it ``keep``s (read by a
    later piece or among the step's results) and the tensors ``reduce``d (averaged across ranks)
    after it.  ``overlap``: the reduction runs while the next pieces compute and only the update
    waits for it (a gradient bucket); otherwise the next piece waits for it (a synchronised
    batch statistic or its adjoint).  ``after``: a piece of the optimizer update, which waits for
    the averages of buckets ``0..after`` (and reads no later one)."""

    ops: tuple[Op, ...]
    keep: tuple[str, ...]
    reduce: tuple[str, ...] = ()
    overlap: bool = True
    after: int | None = None


@dataclass(frozen=True)
class StepSplit:
    """A training step split for data-parallel runs: ``segments`` run in order, the last ones
    being the optimizer update's pieces; ``buckets`` are the gradient buckets (gradient tensor
    names, in the order the reverse pass completes them; the first also carries the loss and the
    running statistics)."""

    segments: tuple[Segment, ...]
    buckets: tuple[tuple[str, ...], ...]

    @property
    def updates(self) -> tuple[Segment, ...]:
        """The optimizer update's pieces (they read the averaged gradients), in bucket order."""
        return tuple(s for s in self.segments if s.after is not None)


def default_bucket_bytes(gradient_bytes: int) -> int:
    """DDP's 25 MiB cap, but a smaller model's gradients still come in ``MIN_BUCKETS`` buckets (of
    at least ``MIN_BUCKET_BYTES``), so its communication overlaps the reverse pass too."""
    return min(BUCKET_CAP_BYTES, max(MIN_BUCKET_BYTES, -(-gradient_bytes // MIN_BUCKETS)))


def split_step(
    training: TrainingGraph, results: Sequence[str], bucket_bytes: int | None = None, sync_bn: bool = False
) -> StepSplit:
    """Split ``training``'s graph for a data-parallel step handing back ``results``.

    Ops that read a gradient (directly or through another such op) form the update; the others
    run in pieces cut after the op completing each gradient bucket (buckets of about
    ``bucket_bytes``, gradients in the order the reverse pass produces them; None:
    ``default_bucket_bytes``) and, with ``sync_bn``, after each batch statistic and each of their
    adjoints.  The loss and the running statistics' next values travel in the first bucket.  The
    update is split by the last bucket each op reads (through the update's own ops), so the
    parameters of the first buckets are updated while the last bucket's average travels."""
    graph = training.graph
    gradients = set(training.gradients.values())
    if not gradients:
        raise CompileError("the training step trains no parameter: there are no gradients to average")
    late = set(gradients)
    early_ops, update_ops = [], []
    for op in graph.ops:
        if late.intersection(op.input_names):
            late.add(op.name)
            update_ops.append(op)
        else:
            early_ops.append(op)
    position = {op.name: k for k, op in enumerate(early_ops)}
    ordered = sorted(gradients, key=position.__getitem__)
    cap = bucket_bytes or default_bucket_bytes(sum(nbytes(graph.tensors[g]) for g in ordered))
    buckets: list[list[str]] = [[]]
    size = 0
    for name in ordered:
        if size >= cap:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes(graph.tensors[name])
    # the running statistics' next values (the optimizer's own early state, Adam's step count, is
    # the same on every rank and not averaged: a sum divided by 3 need not give it back exactly)
    extras = [training.loss] + [v for t, v in training.updates.items() if v in position and t not in training.state]
    first = [*dict.fromkeys(extras), *buckets[0]]
    buckets[0] = first
    closing = {max(position[n] for n in bucket): tuple(bucket) for bucket in buckets}
    synced: dict[int, tuple[str, ...]] = {}
    if sync_bn:
        for statistic, adjoint in training.batch_statistics.items():
            for name in (statistic, adjoint):
                if name is not None and name in position:
                    synced[position[name]] = (name,)
    cut: list[tuple[list[Op], tuple[str, ...], bool]] = [([], (), True)]  # ops, reduced after them, overlap
    for k, op in enumerate(early_ops):
        cut[-1][0].append(op)
        for reduced, overlap in ((synced.get(k), False), (closing.get(k), True)):
            if reduced:
                cut[-1] = (cut[-1][0], reduced, overlap)
                cut.append(([], (), True))
    if not cut[-1][0]:
        cut.pop()
    pieces = [Segment(tuple(ops), (), reduced, overlap) for ops, reduced, overlap in cut]
    pieces += _update_pieces(update_ops, buckets)
    wanted = set(results)
    segments = []
    for k, piece in enumerate(pieces):
        later = {name for other in pieces[k + 1 :] for op in other.ops for name in op.input_names}
        keep = [op.name for op in piece.ops if op.name in later or op.name in wanted or op.name in piece.reduce]
        segments.append(replace(piece, keep=tuple(keep)))
    return StepSplit(tuple(segments), tuple(tuple(b) for b in buckets))


def _update_pieces(update_ops: Sequence[Op], buckets: Sequence[Sequence[str]]) -> list[Segment]:
    """The update's ops (in graph order) in one piece per bucket: an op goes with the last bucket
    among the averaged tensors it reads and the update ops it reads (an op reading none of them,
    with the first)."""
    bucket_of = {name: k for k, bucket in enumerate(buckets) for name in bucket}
    for op in update_ops:
        bucket_of[op.name] = max((bucket_of.get(name, 0) for name in op.input_names), default=0)
    grouped = [[op for op in update_ops if bucket_of[op.name] == k] for k in range(len(buckets))]
    return [Segment(tuple(ops), (), after=k) for k, ops in enumerate(grouped) if ops]


# --------------------------------------------------------------------------- joining


@dataclass(frozen=True)
class World:
    """This process's place in a data-parallel run: ``rank`` of ``size``, ``local_rank`` on its
    host, and the ``backend`` (``gloo`` or ``nccl``)."""

    rank: int
    size: int
    local_rank: int
    backend: str


def _torch_distributed():
    try:
        import torch.distributed as dist
    except ImportError as err:
        raise InputError("data-parallel training needs PyTorch (pip install 'neoflow[torch]')") from err
    if not dist.is_available():
        raise InputError("this PyTorch was built without torch.distributed")
    return dist


def launched() -> bool:
    """Whether this process is a worker of a ``torchrun`` launch (``WORLD_SIZE`` and ``RANK`` set)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def claim_device() -> int:
    """The GPU of this rank: ``NEOFLOW_CUDA_DEVICE`` where set, else ``LOCAL_RANK`` (then set as
    ``NEOFLOW_CUDA_DEVICE``, which the cuda target's driver opens).  Call it before anything
    touches the GPU (a cuda compile asks the GPU's architecture)."""
    os.environ.setdefault("NEOFLOW_CUDA_DEVICE", os.environ.get("LOCAL_RANK", "0"))
    return int(os.environ["NEOFLOW_CUDA_DEVICE"])


def join(target: str = "cpu") -> World:
    """Join the process group ``torchrun`` describes in the environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``; its rendezvous, single- or multi-node): NCCL for the ``cuda``
    target, each rank on GPU ``LOCAL_RANK``; gloo otherwise.  A group already joined is reused."""
    dist = _torch_distributed()
    backend = "nccl" if target in DEVICE_TARGETS else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if not dist.is_initialized():
        if not launched():
            raise InputError("not started by torchrun: RANK and WORLD_SIZE are not set (use neoflow train --nproc N)")
        if backend == "nccl":
            import torch

            os.environ.update(nccl_environment(os.environ))
            torch.cuda.set_device(claim_device())
            # NCCL on a high-priority stream: a bucket's all-reduce takes the first free SMs
            # instead of queuing behind the reverse pass's next kernels
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = True
            device = torch.device("cuda", torch.cuda.current_device())
            dist.init_process_group("nccl", device_id=device, pg_options=options)
        else:
            dist.init_process_group("gloo")
    elif dist.get_backend() != backend:
        raise InputError(f"the process group uses {dist.get_backend()}; the {target} target needs {backend}")
    return World(dist.get_rank(), dist.get_world_size(), local_rank, backend)


def nccl_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The NCCL settings a data-parallel run joins with, where ``environ`` sets none of its own:
    ``NCCL_GRAPH_MIXING_SUPPORT=0``.  A step's collectives are captured in its CUDA graph, and the
    only others (the parameters' check) are queued on the step's stream after it, never beside a
    captured one; the support for mixing the two adds synchronisation to every captured collective
    (on 2 H200s the all-reduces added 0.011-0.016 ms to a step with it off, 0.019-0.031 ms
    with it on; ``benchmarks/distributed_cuda.md``)."""
    return {key: value for key, value in {"NCCL_GRAPH_MIXING_SUPPORT": "0"}.items() if key not in environ}


#: the runners of this process, closed before it leaves the group
_RUNNERS: weakref.WeakSet = weakref.WeakSet()


def leave() -> None:
    """Close this process's runners and leave the process group (a process that exits without
    leaving it may abort; NCCL's leave waits forever while a CUDA graph holding its kernels lives)."""
    for runner in list(_RUNNERS):
        runner.close()
    dist = _torch_distributed()
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------- arrays


class _HostArrays:
    """Tensors in host memory (numpy arrays), reduced by gloo through torch tensors sharing their
    memory; each bucket is averaged in a flat buffer of its own, reused every step.  ``queues``:
    whether a step can be queued without waiting for it (here not: host work runs as called)."""

    queues = False

    def __init__(self, runner: DataParallel) -> None:
        self.runner = runner
        self.torch = runner.torch
        self.scale = 1.0 / runner.world.size
        self.buffers: dict[tuple, np.ndarray] = {}
        self.reduce_op = runner.dist.ReduceOp.SUM  # gloo has no average: ``averaged`` scales the sum

    def on_stream(self):
        """A context the step's work is queued in (none here: host work runs as it is called)."""
        return contextlib.nullcontext()

    def feed(self, feed: dict) -> dict:
        return feed

    def step(self, values: dict, body) -> dict:
        """The step's results: ``body(values)``."""
        return body(values)

    def run(self, number: int, values: dict) -> dict:
        runner = self.runner
        inputs = {t.name: values[t.name] for t in runner.graphs[number].inputs}
        return runner.executors[number].run(inputs, recycle=True)

    def flat(self, names: tuple[str, ...], arrays: Sequence[np.ndarray]) -> np.ndarray:
        key = (names, arrays[0].dtype.str)
        if key not in self.buffers:
            self.buffers[key] = np.empty(sum(a.size for a in arrays), arrays[0].dtype)
        return np.concatenate([np.ravel(a) for a in arrays], out=self.buffers[key])

    def shared(self, flat: np.ndarray):
        return self.torch.from_numpy(flat)

    def averaged(self, flat: np.ndarray) -> np.ndarray:
        """The average from the ranks' sum ``reduce_op`` left in ``flat``."""
        flat *= flat.dtype.type(self.scale)
        return flat

    def collective(self, tensor):
        """``tensor`` where the process group's collectives take it (host memory for gloo)."""
        return tensor

    def views(self, names: tuple[str, ...], flat: np.ndarray, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
        """The tensors ``names`` (of ``shapes``) as views of their bucket's flat buffer ``flat``."""
        sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        return [part.reshape(s) for part, s in zip(np.split(flat, np.cumsum(sizes)[:-1]), shapes, strict=True)]

    def to_host(self, value) -> np.ndarray:
        return np.asarray(value)

    def keep_updates(self, outputs: Mapping[str, object]) -> None:
        model = self.runner.model
        for target, next_value in model.training.updates.items():
            model._values[target] = outputs[next_value]

    def current(self, name: str):
        return self.torch.from_numpy(np.ascontiguousarray(self.runner.model._values[name]))

    def write_back(self) -> None:
        """Nothing to copy: the model's own arrays are the current values."""

    def close(self) -> None:
        """Nothing held: host work is done when it returns."""


class _DeviceArrays(_HostArrays):
    """Tensors on this rank's GPU as torch CUDA tensors, in buffers of their own reused every step
    (parameters and state stay there between steps, in two sets taken in turn: a step's update
    writes the next values into the set the next step reads).
    Every piece of the step and the buckets' all-reduces (NCCL's stream, forked from the step's and
    joined back where the update waits) are queued on the stream the cuda target's kernels run on,
    so a bucket's all-reduce overlaps the pieces queued after it.  After ``EAGER_STEPS`` steps run
    as they are queued, the whole step is captured as one CUDA graph (NCCL's kernels included) and
    replayed: a step then costs the host one launch instead of hundreds of calls."""

    EAGER_STEPS = 2
    queues = True
    #: where each tensor placed in a bucket's flat buffer starts (bytes)
    ALIGN = 256

    def __init__(self, runner: DataParallel) -> None:
        super().__init__(runner)
        from neoflow.targets.cuda import driver

        torch = self.torch
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.reduce_op = runner.dist.ReduceOp.AVG  # NCCL averages itself
        model = runner.model
        current = {name: self.upload(model._values[name]) for name in runner.state_names}
        # two sets of parameters and state, taken in turn: a step reads one and its update writes
        # the next values straight into the other (no copy after the update)
        self.sets = (current, {name: value.clone() for name, value in current.items()})
        self.parity = 0
        tensors = model.training.graph.tensors
        self.layouts: dict[tuple, list] = {}  # a placed buffer's key -> its tensors' views
        placed = self._place_reductions(tensors)
        shared = [
            {name: placed[name] if name in placed else self.empty(graph.tensors[name]) for name in segment.keep}
            for graph, segment in zip(runner.graphs, runner.split.segments, strict=True)
        ]
        updated = {op.name for segment in runner.split.updates for op in segment.ops}
        self.written = {n: t for t, n in reversed(model.training.updates.items()) if n in updated}
        self.copied_over = {t: n for t, n in model.training.updates.items() if self.written.get(n) != t}
        self.outputs = tuple(  # per parity: the update writes the next values into the other set
            [{name: other.get(self.written.get(name), value) for name, value in outs.items()} for outs in shared]
            for other in reversed(self.sets)
        )
        self.inputs: dict[str, object] = {}
        self.staging: dict[tuple[str, int], object] = {}  # pinned host buffers of the inputs, two each
        self.copied: dict[tuple[str, int], object] = {}  # the event after each one's last copy
        # the kernels' own stream: a capture on it records them, the all-reduces and the copies alike
        self.stream = torch.cuda.ExternalStream(int(driver.device().stream), device=self.device)
        self.steps = 0
        self.graphs: dict[int, object] = {}  # per parity, its captured step
        self.captured: dict[int, dict[str, object]] = {}

    def _place_reductions(self, tensors: Mapping) -> dict[str, object]:
        """A flat buffer for each reduction (per dtype) and its tensors' views into it, by name:
        the pieces write those tensors straight into the buffer the all-reduce works on, so no
        copy gathers a bucket before it travels.  Each view starts on an ``ALIGN``-byte boundary,
        as an allocation would (the kernels load 16 bytes at a time); the gaps stay zero."""
        torch = self.torch
        placed: dict[str, object] = {}
        for segment in self.runner.split.segments:
            groups = _by_dtype(segment.reduce, lambda name: str(_torch_dtype(torch, tensors[name].dtype)))
            for kind, group in groups.items():
                dtype = _torch_dtype(torch, tensors[group[0]].dtype)
                step = max(1, self.ALIGN // dtype.itemsize)
                sizes = [int(np.prod(tensors[name].shape, dtype=np.int64)) for name in group]
                starts = np.concatenate([[0], np.cumsum([-(-n // step) * step for n in sizes])])
                flat = torch.zeros(int(starts[-1]), dtype=dtype, device=self.device)
                views = [
                    flat[int(a) : int(a) + n].view(tensors[name].shape)
                    for a, n, name in zip(starts[:-1], sizes, group, strict=True)
                ]
                self.buffers[(group, kind)], self.layouts[(group, kind)] = flat, views
                placed.update(zip(group, views, strict=True))
        return placed

    @property
    def values(self) -> dict[str, object]:
        """The current parameters and optimizer state by name."""
        return self.sets[self.parity]

    def on_stream(self):
        return self.torch.cuda.stream(self.stream)

    def empty(self, tensor):
        return self.torch.empty(tensor.shape, dtype=_torch_dtype(self.torch, tensor.dtype), device=self.device)

    def upload(self, array: np.ndarray):
        return self.torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def feed(self, feed: dict) -> dict:
        """The step's inputs: the parameters and state where they are, the batch (and the learning
        rate) copied into buffers of their own through pinned host memory without waiting (two
        staging buffers each, taken in turn: the copy queued two steps ago has read the one
        written now), so the host prepares a step while the GPU runs the one before."""
        torch = self.torch
        values = dict(self.values)
        slot = self.steps % 2
        for name, value in feed.items():
            if name in values:
                continue
            array = np.asarray(value)  # a scalar (the learning rate) stays 0-d
            key = (name, slot)
            if name not in self.inputs:
                self.inputs[name] = torch.empty(
                    array.shape, dtype=_torch_dtype(torch, str(array.dtype)), device=self.device
                )
            if key not in self.staging:
                self.staging[key] = torch.empty(array.shape, dtype=self.inputs[name].dtype, pin_memory=True)
            elif key in self.copied:
                self.copied[key].synchronize()
            self.staging[key].numpy()[...] = array
            values[name] = self.inputs[name].copy_(self.staging[key], non_blocking=True)
            self.copied[key] = torch.cuda.Event()
            self.copied[key].record(self.stream)
        return values

    def step(self, values: dict, body) -> dict:
        """The step's results: ``body(values)`` run as queued for the first steps, then captured
        once as a CUDA graph and replayed (its inputs' buffers hold this step's values)."""
        self.steps += 1
        if self.steps <= self.EAGER_STEPS:
            return body(values)
        parity = self.parity
        if parity not in self.graphs:
            self.stream.synchronize()
            self.graphs[parity] = self.torch.cuda.CUDAGraph()
            with self.torch.cuda.graph(self.graphs[parity], stream=self.stream, capture_error_mode="thread_local"):
                self.captured[parity] = body(values)
        self.graphs[parity].replay()
        return self.captured[parity]

    def run(self, number: int, values: dict) -> dict:
        runner = self.runner
        outputs = self.outputs[self.parity][number]
        runner.executors[number].enqueue({t.name: values[t.name] for t in runner.graphs[number].inputs}, outputs)
        return outputs

    def flat(self, names: tuple[str, ...], arrays: Sequence) -> object:
        key = (names, str(arrays[0].dtype))
        if key in self.layouts:  # the pieces wrote the tensors into it (any other is copied in)
            moved = [(view, a) for view, a in zip(self.layouts[key], arrays, strict=True) if view is not a]
            if moved:
                self.torch._foreach_copy_(*map(list, zip(*moved, strict=True)))
            return self.buffers[key]
        if key not in self.buffers:
            size = sum(a.numel() for a in arrays)
            self.buffers[key] = self.torch.empty(size, dtype=arrays[0].dtype, device=self.device)
        return self.torch.cat([a.reshape(-1) for a in arrays], out=self.buffers[key])

    def shared(self, flat):
        return flat

    def averaged(self, flat):
        return flat  # averaged by NCCL (``reduce_op``)

    def collective(self, tensor):
        return tensor.to(self.device)

    def views(self, names: tuple[str, ...], flat, shapes: Sequence[tuple[int, ...]]) -> list:
        placed = self.layouts.get((names, str(flat.dtype)))
        if placed is not None:  # the pieces' own views, each where ``_place_reductions`` put it
            return placed
        sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        return [part.view(s) for part, s in zip(self.torch.split(flat, sizes), shapes, strict=True)]

    def to_host(self, value) -> np.ndarray:
        return value.detach().cpu().numpy()

    def keep_updates(self, outputs: Mapping[str, object]) -> None:
        """The other set becomes the current one: the update wrote most next values there; the
        others (the running statistics, computed before the update) are copied in (queued)."""
        other = self.sets[1 - self.parity]
        if self.copied_over:
            targets, sources = zip(*self.copied_over.items(), strict=True)
            self.torch._foreach_copy_([other[t] for t in targets], [outputs[n] for n in sources])
        self.parity = 1 - self.parity

    def current(self, name: str):
        return self.values[name]

    def close(self) -> None:
        self.stream.synchronize()
        for graph in self.graphs.values():
            graph.reset()
        self.graphs, self.captured, self.steps = {}, {}, 0

    def write_back(self) -> None:
        self.stream.synchronize()
        for name, value in self.values.items():
            self.runner.model._values[name] = self.to_host(value).copy()


def _torch_dtype(torch, dtype: str):
    """The torch dtype of a graph dtype."""
    return torch.bfloat16 if dtype == "bfloat16" else getattr(torch, dt.numpy_dtype(dtype).name)


def _by_dtype(names: Sequence[str], dtype_of) -> dict[str, tuple[str, ...]]:
    """``names`` grouped by ``dtype_of(name)`` (a string), each group in the order given."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(dtype_of(name), []).append(name)
    return {kind: tuple(group) for kind, group in groups.items()}


def _digests(torch, tensors: Sequence) -> object:
    """Per tensor, the sum of its 32-bit words and of the words weighted by their position modulo
    a prime: equal tensors have equal digests, and a tensor changed anywhere almost surely not."""
    rows = []
    for tensor in tensors:
        flat = tensor.detach().reshape(-1).contiguous()
        if flat.element_size() != 4:
            flat = flat.to(torch.float32)
        words = flat.view(torch.int32).to(torch.int64)
        weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64) % 65521 + 1
        rows.append(torch.stack([words.sum(), (words * weights).sum()]))
    return torch.stack(rows) if rows else torch.zeros((0, 2), dtype=torch.int64)


# --------------------------------------------------------------------------- the runner


@dataclass
class _Pending:
    """A reduction started: the names averaged per dtype, their flat buffers, the work handles."""

    names: dict[str, tuple[str, ...]]
    flats: dict[str, object]
    works: list


class DataParallel:
    """Runs a ``CompiledModel``'s training step data-parallel over the process group.

    ``train_step(batch)`` takes this rank's shard of the global batch (numpy arrays; the model is
    compiled for the shard's shape) and returns the loss averaged over the ranks.  Gradients are
    averaged in buckets (``bucket_bytes``; None: ``default_bucket_bytes``) whose all-reduce
    overlaps the rest of the reverse pass.  BatchNorm uses each rank's own batch statistics, as
    PyTorch's DDP does; ``sync_bn=True`` averages them (forward and backward).  The running
    statistics are averaged with the first bucket.  Every ``check_every`` steps (and at the start)
    the parameters and optimizer state are compared across ranks (a digest of each, gathered): a
    difference is a ``DistributedError`` naming the tensor.  ``reduce=False`` skips every
    collective (for timing the step without them: the ranks then drift apart).  On the ``cuda``
    target the parameters stay on the GPU between steps: ``synchronize()`` copies them back into
    the model."""

    def __init__(
        self,
        model: CompiledModel,
        world: World | None = None,
        bucket_bytes: int | None = None,
        sync_bn: bool = False,
        check_every: int = CHECK_EVERY,
        reduce: bool = True,
    ) -> None:
        training = model._require_training()
        self.dist = _torch_distributed()
        import torch

        self.torch = torch
        self.model = model
        self.world = world or join(model.target)
        self.check_every = check_every
        self.reduce_enabled = reduce and self.world.size > 1  # an average over one rank is its value
        self.results = [training.loss, *training.updates.values()]
        if model.spec.keep_prediction:
            self.results.append(training.prediction)
        self.split = split_step(training, self.results, bucket_bytes, sync_bn)
        self.graphs = [Graph.from_ops(list(s.ops), outputs=list(s.keep)) for s in self.split.segments]
        self.executors = [
            build_executor(model.target, graph, segment.keep, model.fusion, model.precision)
            for graph, segment in zip(self.graphs, self.split.segments, strict=True)
        ]
        self.state_names = [*model._parameter_names, *training.state]
        self.arrays = _DeviceArrays(self) if model.target in DEVICE_TARGETS else _HostArrays(self)
        self.average = self.arrays.reduce_op
        _RUNNERS.add(self)
        self._loss = None
        self.check_consistent()

    def train_step(self, batch: Mapping[str, np.ndarray], check: bool = False, wait: bool = True) -> float | None:
        """One data-parallel optimizer step on this rank's shard ``batch``; the loss before the
        step, averaged over the ranks.  ``check``: a loss or update that is not finite is a
        ``NumericError`` (as ``CompiledModel.train_step`` checks).  ``wait=False`` (the cuda
        target): the step is queued and None returned at once, so the host prepares the next step
        while the GPU runs this one, as a training loop that reads its loss now and then does
        (``last_loss()`` reads it); a host-memory run always waits."""
        with self.arrays.on_stream():
            return self._step(batch, check, wait)

    def last_loss(self) -> float:
        """The loss of the last step (waiting for it), averaged over the ranks."""
        if self._loss is None:
            raise InputError("no training step has run yet")
        with self.arrays.on_stream():
            return float(self.arrays.to_host(self._loss))

    def _step(self, batch: Mapping[str, np.ndarray], check: bool, wait: bool) -> float | None:
        model, training = self.model, self.model.training
        outputs = self.arrays.step(self.arrays.feed(model._training_feed(batch)), self._pieces)
        if check:
            model._check_finite(training, {name: self.arrays.to_host(v) for name, v in outputs.items()})
        self.arrays.keep_updates(outputs)
        model.step += 1
        if model.spec.keep_prediction:  # then the prediction is among the results
            model.last_prediction = np.array(self.arrays.to_host(outputs[training.prediction]))
        if self.check_every and model.step % self.check_every == 0:
            self._check_consistent()
        self._loss = outputs[training.loss]
        if not wait and self.arrays.queues:
            return None
        return float(self.arrays.to_host(self._loss))

    def _pieces(self, values: dict) -> dict:
        """Run the step's pieces on ``values`` (every input), averaging each piece's reductions
        (an update piece waits for the buckets it reads); the step's results by name."""
        pending: list[_Pending] = []  # the buckets' reductions, in bucket order
        arrived = 0
        for number, segment in enumerate(self.split.segments):
            if segment.after is not None:
                while arrived <= segment.after and arrived < len(pending):
                    self._finish(pending[arrived], values)
                    arrived += 1
            values.update(self.arrays.run(number, values))
            if segment.reduce and self.reduce_enabled:
                started = self._start(segment.reduce, values)
                if segment.overlap:
                    pending.append(started)
                else:
                    self._finish(started, values)
        return {name: values[name] for name in self.results}

    def _start(self, names: Sequence[str], values: dict) -> _Pending:
        """Start averaging ``names`` across ranks (one flat buffer per dtype), not waiting."""
        groups = _by_dtype(names, lambda name: str(values[name].dtype))
        flats, works = {}, []
        for kind, group in groups.items():
            flats[kind] = self.arrays.flat(group, [values[n] for n in group])
            works.append(self.dist.all_reduce(self.arrays.shared(flats[kind]), op=self.average, async_op=True))
        return _Pending(groups, flats, works)

    def _finish(self, pending: _Pending, values: dict) -> None:
        """Wait for ``pending``'s reduction; its averages replace the tensors in ``values``."""
        for work in pending.works:
            work.wait()
        for kind, group in pending.names.items():
            flat = self.arrays.averaged(pending.flats[kind])
            shapes = [tuple(values[n].shape) for n in group]
            values.update(zip(group, self.arrays.views(group, flat, shapes), strict=True))

    def check_consistent(self) -> None:
        """Compare every parameter and optimizer state tensor across ranks (a digest of each's
        bits, gathered); a ``DistributedError`` names the first that differs."""
        with self.arrays.on_stream():
            self._check_consistent()

    def _check_consistent(self) -> None:
        if not self.reduce_enabled:
            return
        digests = self.arrays.collective(_digests(self.torch, [self.arrays.current(n) for n in self.state_names]))
        gathered = [self.torch.zeros_like(digests) for _ in range(self.world.size)]
        self.dist.all_gather(gathered, digests)
        table = np.stack([g.cpu().numpy() for g in gathered])
        differs = np.flatnonzero((table != table[0]).any(axis=(0, 2)))
        if differs.size:
            k = int(differs[0])
            rank = next(r for r in range(self.world.size) if (table[r, k] != table[0, k]).any())
            raise DistributedError(
                f"'{self.model.public_name(self.state_names[k])}' differs between rank 0 and rank {rank} "
                f"after step {self.model.step}: the ranks' parameters diverged"
            )

    def close(self) -> None:
        """Wait for the step's work and drop the captured CUDA graph (steps after it run as they
        are queued until it is captured again)."""
        self.arrays.close()

    def synchronize(self) -> None:
        """Copy the parameters and optimizer state held on the GPU back into the model (what its
        ``parameters``, ``save`` and ``export_onnx`` read); a host-memory run keeps them there."""
        self.arrays.write_back()


# --------------------------------------------------------------------------- launching


def launch(nproc: int, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    """Run ``python argv...`` as ``nproc`` local workers through torchrun's own launcher (its
    elastic agent and c10d rendezvous on a free local port), in this environment plus ``env``,
    each with ``NEOFLOW_NUM_THREADS`` (unless set) a share of this machine's cores.  Returns when
    every worker has finished; a failed worker stops the others and is a ``DistributedError``
    naming its rank and its error line (``record_failure`` leaves it)."""
    if nproc < 1:
        raise InputError(f"--nproc must be at least 1, got {nproc}")
    _torch_distributed()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    share = str(max(1, (os.cpu_count() or 1) // nproc))
    workers = {"NEOFLOW_NUM_THREADS": share, "OMP_NUM_THREADS": share}
    workers = {k: v for k, v in workers.items() if k not in os.environ} | dict(env or {}) | {LAUNCHED_BY: "1"}
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"neoflow-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
    )
    try:
        with _environment(workers):  # the workers inherit it; this process gets its own back
            elastic_launch(config, sys.executable)(*argv)
    except ChildFailedError as err:
        rank, failure = min(err.failures.items(), key=_first_cause)
        message = failure.message if isinstance(failure.message, str) else ""
        message = message.removeprefix("neoflow: ")
        if not message or message.startswith("To enable traceback"):
            message = "see its output above" if failure.exitcode >= 0 else f"signal {-failure.exitcode}"
        # a rank that left its error and was then stopped with the others exits by a signal: not its cause
        code = f" (exit code {failure.exitcode})" if failure.exitcode > 0 else ""
        raise DistributedError(f"rank {rank} failed{code}: {message}; the other ranks were stopped") from None


def _first_cause(item: tuple[int, object]) -> tuple:
    """How early a worker's failure was: the ones that left their error line first (to the
    microsecond: a rank that failed because its peer had gone fails within the same second),
    then the others by the launcher's timestamps."""
    rank, failure = item
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    recorded = data.get("neoflow_time")
    return (recorded is None, recorded or 0.0, failure.timestamp, rank)


@contextlib.contextmanager
def _environment(values: Mapping[str, str]):
    """``values`` set in ``os.environ`` for the block, the previous environment restored after it."""
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def record_failure(line: str) -> bool:
    """In a worker ``launch`` started, leave ``line`` (its one-line error) where the launcher reads
    a failed worker's cause (torchelastic's error file), and say so (the launcher prints it); a
    worker of another launch (a user's own ``torchrun``) also leaves it there but prints it too."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    try:
        with open(path, "w") as file:
            now = time.time()
            json.dump({"message": line, "timestamp": int(now), "neoflow_time": now}, file)
    except OSError:
        return False
    return os.environ.get(LAUNCHED_BY) == "1"
