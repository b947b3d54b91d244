"""Executors of the tensor-core plans: the model (numpy, anywhere) and the GPU (NVRTC + the driver).

Both plan every op of the fused graph the same way (``plan.plan_op``, in the
graph's precision) and free tensors at their last use; the model executes the
plans in numpy and predicts each kernel's time, the GPU executor compiles one
module of all the kernels, keeps every tensor in device memory and runs a whole
call as one CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np

from neoflow.errors import CompileError, InputError
from neoflow.ir import dtypes as dt
from neoflow.ir.graph import Graph
from neoflow.ir.op import Op
from neoflow.targets.base import OpByOpExecutor, run_graph, sequential_call
from neoflow.targets.cuda.concurrency import MAX_LANES, ops_beside_others, plan_schedule
from neoflow.targets.cuda.emit import module_source
from neoflow.targets.cuda.model import run_plan
from neoflow.targets.cuda.plan import DEFAULT_ARCH, DEFAULT_PRECISION, MmaKernel, OpPlan, check_precision, plan_op
from neoflow.targets.cuda.timing import predict_kernel
from neoflow.targets.memory import nbytes


def graph_plans(graph: Graph, precision: str, arch: str = DEFAULT_ARCH) -> list[OpPlan]:
    """The kernel plan of every op of ``graph`` for a GPU of ``arch`` (kernels named ``nf_<position>``),
    those running beside other work (``ops_beside_others``) planned for it."""
    beside = ops_beside_others(graph)
    return [plan_op(op, f"nf_op{k}", precision, arch, beside=op.name in beside) for k, op in enumerate(graph.ops)]


class PlannedExecutor(OpByOpExecutor):
    """What both executors hold besides the graph, the kept tensors and the memory plan: the
    ``precision`` and every op's kernel plan for a GPU of ``arch`` (``plans``, by op name, in the
    graph's order; ``plans`` gives them instead, as a tuner's candidates).  A fusion plan's kernel
    groups and sliced kernels change nothing: every op runs as its own kernels."""

    def __init__(
        self,
        graph: Graph,
        keep: Collection[str],
        groups: Collection[Collection[str]] = (),
        sliced: Collection = (),
        precision: str = DEFAULT_PRECISION,
        arch: str = DEFAULT_ARCH,
        plans: Sequence[OpPlan] | None = None,
    ) -> None:
        super().__init__(graph, keep)
        self.precision = check_precision(precision)
        self.fixed_plans = plans is not None  # given (a tuner's candidates): never planned again
        if plans is None:
            self.plan_for(arch)
        else:
            self.arch, self.plans = arch, {plan.op.name: plan for plan in plans}

    def plan_for(self, arch: str) -> None:
        """Plan every op for a GPU of ``arch`` (``plans``)."""
        self.arch = arch
        self.plans = {plan.op.name: plan for plan in graph_plans(self.graph, self.precision, arch)}


class ModelExecutor(PlannedExecutor):
    """Runs ``graph`` on the tensor-core model: each op's kernels executed in numpy;
    ``predicted`` holds each op's predicted seconds on the GPU (``timing``)."""

    target = "tensorcore"

    def __init__(self, graph: Graph, keep: Collection[str], groups=(), sliced=(), precision=DEFAULT_PRECISION) -> None:
        super().__init__(graph, keep, groups, sliced, precision)
        self.predicted = {name: sum(predict_kernel(k) for k in p.kernels) for name, p in self.plans.items()}

    def run_op(self, op: Op, values: Mapping[str, np.ndarray]) -> np.ndarray:
        """The value of ``op`` as its kernels compute it."""
        return run_plan(self.plans[op.name], {t.name: values[t.name] for t in op.inputs})

    def op_call(self, op: Op, values: Mapping[str, np.ndarray]) -> Callable[[], np.ndarray]:
        return lambda: self.run_op(op, values)

    def kernel_call(self, names: Collection[str], values: Mapping[str, np.ndarray]) -> Callable[[], dict]:
        return sequential_call(self, names, values)

    def run(self, inputs: Mapping[str, np.ndarray], recycle: bool = False) -> dict[str, np.ndarray]:
        """The kept tensors by name, from every graph input by name."""
        return run_graph(self, inputs)

    def model_seconds(self, names: Collection[str]) -> float:
        """Predicted GPU seconds of the ops ``names`` (one kernel of a fusion plan): what the
        fusion report shows for this target instead of a wall-clock time of numpy."""
        return sum(self.predicted[name] for name in names)

    def describe(self) -> list[tuple[str, str, float]]:
        """Per kernel: its name, what it is (tiles and precision, or SIMT) and its predicted seconds."""
        rows = []
        for name, plan in self.plans.items():
            for kernel in plan.kernels:
                if isinstance(kernel, MmaKernel):
                    t = kernel.tiles
                    what = f"mma {kernel.precision} {t.block_m}x{t.block_n}x{t.block_k} grid {kernel.grid}"
                else:
                    what = f"simt grid {kernel.grid}"
                rows.append((f"{name} ({kernel.name})", what, predict_kernel(kernel)))
        return rows


class CudaExecutor(PlannedExecutor):
    """Runs ``graph`` on the GPU: one NVRTC module of every op's kernels; every tensor in
    device memory (``arch``: the architecture compiled for before a GPU is found; default the GPU's,
    else ``sm_90``); a run uploads the inputs, replays the captured CUDA graph of all the
    launches and downloads the kept tensors."""

    target = "cuda"

    def __init__(
        self,
        graph: Graph,
        keep: Collection[str],
        groups=(),
        sliced=(),
        precision: str = DEFAULT_PRECISION,
        arch: str | None = None,
        plans: Sequence[OpPlan] | None = None,
    ) -> None:
        from neoflow.targets.cuda import driver
        from neoflow.targets.cuda.nvrtc import compile_cubin

        super().__init__(graph, keep, groups, sliced, precision, arch or driver.default_arch(), plans)
        self.source = module_source(list(self.plans.values()))
        self.cubin = compile_cubin(self.source, self.arch)
        self.device = None  # the GPU is found at the first run: compiling needs NVRTC only
        self.module = None
        self.tensors = graph.tensors
        self.buffers: dict[str, driver.Buffer] = {}
        self._graphs: dict[tuple, driver.Graph] = {}  # by the caller's GPU arrays bound (name, pointer)
        self._graph = None  # the last run's

    def artifacts(self) -> dict[str, bytes]:
        """What a build directory keeps of this executor, by file suffix: the CUDA and its cubin."""
        return {".cu": self.source.encode(), f".{self.cubin.arch}.cubin": self.cubin.path.read_bytes()}

    def _attach(self) -> None:
        """Find the GPU, load the module (rebuilt for the GPU's architecture) and allocate every tensor."""
        from neoflow.targets.cuda import driver
        from neoflow.targets.cuda.nvrtc import compile_cubin

        self.device = driver.device()
        driver.make_current(self.device)
        if self.cubin.arch != self.device.arch:  # planned for another GPU: plan and build again
            if self.fixed_plans:
                raise CompileError(f"plans given for {self.arch} cannot run on this GPU ({self.device.arch})")
            self.plan_for(self.device.arch)
            self.source = module_source(list(self.plans.values()))
            self.cubin = compile_cubin(self.source, self.device.arch)
        self.module = driver.Module(self.cubin.path.read_bytes())
        # intermediates share one arena at the memory plan's offsets; inputs and kept tensors have their own
        self.arena = driver.Buffer(self.plan.arena_bytes)
        for tensor in [*self.graph.inputs, *(op.output for op in self.graph.ops)]:
            if tensor.name in self.plan.offsets and tensor.name not in self.keep:
                self.buffers[tensor.name] = driver.View(self.arena, self.plan.offsets[tensor.name], nbytes(tensor))
            else:
                self.buffers[tensor.name] = driver.Buffer(nbytes(tensor))
        # a split op's float32 workspace (each its own: ops of a captured graph run in order), zeroed
        # once here: each finishing kernel zeroes what it has read, so no run needs a memset for it
        self.workspaces = {
            name: driver.Buffer(plan.op.output.size * 4) for name, plan in self.plans.items() if plan.workspace
        }
        for workspace in self.workspaces.values():
            driver.memset_zero(workspace.pointer, workspace.nbytes, self.device.stream)
        driver.synchronize(self.device.stream)
        tasks = sum(len(plan.kernels) + 1 for plan in self.plans.values())
        self.lanes = driver.Lanes(self.device.stream, MAX_LANES, tasks)
        self.tables: dict[str, list[driver.Buffer]] = {}  # each kernel's index tables, uploaded once
        for plan in self.plans.values():
            for kernel in plan.kernels:
                if isinstance(kernel, MmaKernel):
                    self.tables[kernel.name] = []
                    for table in kernel.tables:
                        buffer = driver.Buffer(table.nbytes)
                        buffer.upload(table)
                        self.tables[kernel.name].append(buffer)

    #: CUDA graphs kept for different sets of the caller's GPU arrays (the oldest dropped first)
    GRAPHS_KEPT = 8

    def _launch_all(self, bound: dict[str, int]) -> list:
        """Every op's kernels (what the CUDA graph captures), each on the lane its ``schedule`` gives,
        after the work it depends on; ``bound``: the device pointers of tensors that live in the
        caller's GPU arrays."""
        from neoflow.targets.cuda import driver

        def pointer(name: str) -> int:
            return bound.get(name, self.buffers[name].pointer)

        plans = list(self.plans.values())
        workspaces = {name: buffer.pointer for name, buffer in self.workspaces.items()}
        order = plan_schedule(plans, pointer, workspaces)
        least, greatest = driver.priority_range()
        urgency = order.urgency(max(1, least - greatest))  # the greatest left to NCCL's high-priority stream
        lanes = self.lanes
        lanes.fork(order.lane_count)
        kept = []
        for number, (task, lane) in enumerate(zip(order.tasks, order.lanes, strict=True)):
            for event in order.waits[number]:
                lanes.wait(lane, event)
            stream = lanes.streams[lane]
            plan = plans[task.op]
            op = plan.op
            pointers = [pointer(op.name), *(pointer(t.name) for t in op.inputs)]
            workspace = self.workspaces.get(op.name)
            if task.piece is None:  # a zeroed output (a workspace is left zeroed by its finishing kernels)
                driver.memset_zero(pointers[0], nbytes(op.output), stream)
            else:
                # at the priority of the chain still to follow it (``Schedule.urgency``)
                priority = least - urgency[number]
                kept += self._launch_kernel(plan.kernels[task.piece], pointers, workspace, stream, priority)
            lanes.record(number, lane)
        last = {lane: number for number, lane in enumerate(order.lanes)}
        for lane, number in last.items():
            if lane:
                lanes.wait(0, number)  # the capture ends on lane 0 with every lane joined
        return kept

    def _launch_kernel(self, kernel, pointers: list[int], workspace, stream, priority: int) -> list:
        """Launch ``kernel`` (and the finishing kernel of a split depth) on ``stream``, at ``priority``."""
        from neoflow.targets.cuda import driver

        if isinstance(kernel, MmaKernel):
            threads, shared = kernel.block_threads, kernel.shared_bytes
        else:
            threads, shared = kernel.threads, 0
        function = self.module.function(kernel.name, shared)
        arguments = pointers + [buffer.pointer for buffer in self.tables.get(kernel.name, [])]
        split = isinstance(kernel, MmaKernel) and kernel.splits > 1
        if split:
            arguments.append(workspace.pointer)
        kept = [driver.launch(function, kernel.grid, threads, shared, arguments, stream, priority)]
        if split:  # the finishing kernel: the workspace's sums through the epilogue
            finish = self.module.function(f"{kernel.name}_finish")
            blocks = (max(1, min(-(-kernel.finish_points // 256), 1 << 16)), 1, 1)
            kept.append(driver.launch(finish, blocks, 256, 0, [*pointers, workspace.pointer], stream, priority))
        return kept

    def _bind(self, arrays: Mapping[str, object], role: str) -> dict[str, int]:
        """The device pointers of the caller's GPU arrays among ``arrays`` (graph inputs; for
        ``role`` ``out``, kept tensors to write, which must all be GPU arrays), checked against
        the tensors' shapes and dtypes."""
        from neoflow.targets.cuda.interop import device_array, is_device_array

        bound = {}
        for name, value in arrays.items():
            if not is_device_array(value):
                if role == "out":
                    raise InputError(f"out '{name}' is not a GPU array (__cuda_array_interface__ or DLPack)")
                continue
            found = device_array(value, name)
            tensor = self.tensors[name]
            if found.shape != tensor.shape or found.dtype != dt.concrete(tensor.dtype):
                raise InputError(
                    f"{role} '{name}' on the GPU is {found.dtype} {list(found.shape)}, "
                    f"expected {dt.concrete(tensor.dtype)} {list(tensor.shape)}"
                )
            bound[name] = found.pointer
        return bound

    def run(
        self,
        inputs: Mapping[str, object],
        recycle: bool = False,
        out: Mapping[str, object] | None = None,
        stream: int | None = None,
    ) -> dict[str, object]:
        """The kept tensors by name, from every graph input by name.  Inputs are numpy arrays
        (uploaded) or GPU arrays (``__cuda_array_interface__`` or DLPack: read where they are,
        after the work pending on the GPU); kept tensors named in ``out`` are written into the
        caller's GPU arrays there (and returned as they are), the others come back as numpy.
        ``stream`` (a caller's CUDA stream handle; every input a GPU array and every kept tensor in
        ``out``): the run is queued on that stream, after the work queued there before it, and the
        call returns without waiting for it — as a framework's own operators run."""
        from neoflow.targets.cuda import driver

        if self.device is None:
            self._attach()
        else:
            driver.make_current(self.device)
        out = dict(out or {})
        unknown = sorted(set(out) - set(self.keep))
        if unknown:
            raise InputError(f"'{unknown[0]}' is not an output of the graph (outputs: {', '.join(self.keep)})")
        bound = self._bind({t.name: inputs[t.name] for t in self.graph.inputs}, "input") | self._bind(out, "out")
        if stream is not None:
            host = [t.name for t in self.graph.inputs if t.name not in bound] + [k for k in self.keep if k not in out]
            if host:
                raise InputError(
                    f"a run on a caller's stream reads and writes GPU arrays only ('{host[0]}' is not one)"
                )
        for tensor in self.graph.inputs:
            if tensor.name not in bound:
                array = np.ascontiguousarray(inputs[tensor.name], dtype=dt.numpy_dtype(tensor.dtype))
                self.buffers[tensor.name].upload(array)
        key = tuple(sorted(bound.items()))
        graph = self._graphs.pop(key, None)
        if graph is None:
            graph = driver.Graph(lambda: self._launch_all(bound), self.device.stream)
            if len(self._graphs) >= self.GRAPHS_KEPT:
                self._graphs.pop(next(iter(self._graphs)))
        self._graphs[key] = self._graph = graph  # the most recent last
        if stream is not None:  # ordered on the caller's stream, like its own kernels
            graph.replay(driver.as_stream(stream))
            return dict(out)
        if bound:
            driver.synchronize_context()  # the caller's streams' work on these arrays comes first
        graph.replay()
        driver.synchronize(self.device.stream)
        results: dict[str, object] = {}
        for name in self.keep:
            if name in out:
                results[name] = out[name]
            else:
                tensor = self.tensors[name]
                results[name] = self.buffers[name].download(tensor.shape, dt.numpy_dtype(tensor.dtype))
        return results

    def enqueue(self, inputs: Mapping[str, object], out: Mapping[str, object]) -> None:
        """Launch every kernel of a run on the GPU's own stream (``driver.device().stream``),
        reading the GPU arrays ``inputs`` (every graph input) and writing the kept tensors into
        the GPU arrays ``out`` (every one), without waiting and without a CUDA graph of its own:
        for a caller capturing its own graph on that stream (a data-parallel step with its
        all-reduces), where a graph launched inside a capture would not be recorded."""
        from neoflow.targets.cuda import driver

        if self.device is None:
            self._attach()
        else:
            driver.make_current(self.device)
        bound = self._bind({t.name: inputs[t.name] for t in self.graph.inputs}, "input") | self._bind(out, "out")
        host = [t.name for t in self.graph.inputs if t.name not in bound] + [k for k in self.keep if k not in out]
        if host:
            raise InputError(f"an enqueued run reads and writes GPU arrays only ('{host[0]}' is not one)")
        self._launch_all(bound)

    @property
    def replay_graph(self):
        """The captured CUDA graph of a run (after the first run), for timing its replays."""
        if self._graph is None:
            raise CompileError("the cuda executor has not run yet: its CUDA graph is captured by the first run")
        return self._graph

    def time(self, inputs: Mapping[str, np.ndarray], repeats: int = 50) -> list[float]:
        """Seconds of each of ``repeats`` replays of the run's CUDA graph on ``inputs`` (uploaded once;
        no copies timed), after one warm-up run."""
        from neoflow.targets.cuda import driver

        self.run(inputs)
        return driver.time_replays(self.replay_graph, repeats)

    def run_op(self, op: Op, values: Mapping[str, np.ndarray]) -> np.ndarray:
        raise CompileError("the cuda executor runs whole graphs (run), not single ops", op=op.name)
