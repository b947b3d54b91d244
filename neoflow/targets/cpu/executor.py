"""The cpu target's executor: one C translation unit per graph, compiled, loaded with ctypes."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from neoflow.errors import CompileError
from neoflow.fusion.slicing import SliceRun
from neoflow.ir import dtypes as dt
from neoflow.ir.graph import Graph
from neoflow.ir.interpreter import evaluate_op
from neoflow.ir.op import Op, positional_names, positional_variables
from neoflow.targets.base import run_graph, sequential_call
from neoflow.targets.cpu.compiler import UNIT, build_library
from neoflow.targets.cpu.gemm import MICROKERNEL
from neoflow.targets.cpu.lower import lower_op
from neoflow.targets.cpu.nest import Nest, nest_function, shared_nest
from neoflow.targets.cpu.prelude import PRELUDE
from neoflow.targets.cpu.slices import sliced_function
from neoflow.targets.cpu.tuning import tuned_choice
from neoflow.targets.memory import MemoryPlan, aligned_buffer, aligned_size, plan_memory

T = TypeVar("T")


def threads() -> int:
    """Threads for compiled kernels: ``NEOFLOW_NUM_THREADS`` or all cores."""
    value = os.environ.get("NEOFLOW_NUM_THREADS")
    return max(1, int(value)) if value and value.isdigit() else os.cpu_count() or 1


def module_source(graph: Graph, skip: Collection[str] = ()) -> tuple[str, dict[str, str], dict[str, str]]:
    """The C source of every op of ``graph`` that has a C lowering (but those in
    ``skip``, which run otherwise): returns the source, the function name of each
    lowered op, and the ops left to the interpreter with the reason.  Ops that
    lower to the same code share one function (buffers are passed by position).
    An op ``neoflow tune`` measured takes the choice it found (``tuning``)."""
    parts = [PRELUDE, MICROKERNEL]
    functions: dict[str, str] = {}
    interpreted: dict[str, str] = {}
    by_code: dict[str, str] = {}
    lowered: dict[Op, tuple[str | None, str]] = {}  # by the op with tensors and variables named by position
    for op in graph.ops:
        if op.name in skip:
            continue
        alike = positional_variables(op)
        key = positional_names(alike)  # copies of a layer are lowered once
        if key not in lowered:
            lowered[key] = _lowered(op, alike)
        code, reason = lowered[key]
        if code is None:
            interpreted[op.name] = reason
            continue
        if code not in by_code:
            by_code[code] = f"nf_kernel{len(by_code)}"
            parts.append(code.replace("KERNEL", by_code[code]))
        functions[op.name] = by_code[code]
    # the functions are units the compiler may spread over translation units compiled in parallel
    return "\n\n".join(parts[:2]) + UNIT + UNIT.join(parts[2:]) + "\n", functions, interpreted


def _lowered(op: Op, alike: Op) -> tuple[str | None, str]:
    """The C of ``op`` (``KERNEL`` its function's name) and, where it has none, why: lowered as ``alike``
    (its variables named by position: copies of a layer, whose adjoints' variables are named after their
    tensors, then lower to one function), or where that fails as it is (a failure's reason then speaks
    of the op's own variables); with the choice ``neoflow tune`` measured, where it did."""
    reason = ""
    for form in (alike, op):
        try:
            code = lower_op(form, "KERNEL")
            choice = tuned_choice(code, threads())
            return (code if choice is None else lower_op(form, "KERNEL", choice)), ""
        except CompileError as err:
            reason = err.message
    return None, reason


def graph_nests(graph: Graph, groups: Collection[Collection[str]], keep: Collection[str] = ()) -> dict[str, Nest]:
    """The groups of ``graph``'s ops (consecutive, one kernel of a fusion plan
    each) that run as one loop nest (``targets.cpu.nest``), by their first op's name.
    A group's ops that nothing outside it reads, not in ``keep`` nor outputs of
    ``graph``, are private to its nest (which may keep them in row buffers)."""
    ops = {op.name: op for op in graph.ops}
    position = {op.name: k for k, op in enumerate(graph.ops)}
    read_by: dict[str, set[str]] = {}
    for op in graph.ops:
        for name in op.input_names:
            read_by.setdefault(name, set()).add(op.name)
    kept = set(keep) | set(graph.outputs)
    nests = {}
    for group in groups:
        members = sorted(group, key=position.__getitem__)
        if len(members) < 2 or position[members[-1]] - position[members[0]] != len(members) - 1:
            continue
        private = [name for name in members if name not in kept and read_by.get(name, set()) <= set(members)]
        nest = shared_nest([ops[name] for name in members], private)
        if nest is not None:
            nests[members[0]] = nest
    return nests


def nest_source(nests: Mapping[str, Nest]) -> tuple[str, dict[str, tuple[Nest, str]]]:
    """The C functions of ``nests`` (``nf_nest<k>``), and by first op each nest with its function's name."""
    parts, named = [], {}
    for k, (first, nest) in enumerate(nests.items()):
        named[first] = (nest, f"nf_nest{k}")
        parts.append(nest_function(nest, f"nf_nest{k}"))
    return UNIT.join(parts) + "\n", named


def tensor_slots(graph: Graph) -> dict[str, int]:
    """The position of each tensor of ``graph`` in ``nf_run_graph``'s pointer array."""
    return {name: k for k, name in enumerate(graph.tensors)}


def sliced_source(graph: Graph, runs: Collection[SliceRun]) -> tuple[str, dict[str, tuple[SliceRun, str]]]:
    """The C functions of the sliced kernels ``runs`` of ``graph`` (``nf_sliced<k>(b)``,
    ``targets.cpu.slices``) and, by first op, each run with its function's name; a run
    whose ops cannot run slice by slice is left out (its ops run one by one)."""
    ops = {op.name: op for op in graph.ops}
    slot = tensor_slots(graph)
    parts, named = [], {}
    for run in runs:
        function = f"nf_sliced{len(named)}"
        try:
            parts.append(sliced_function([ops[n] for n in run.ops], run.length, run.private, slot, function))
        except CompileError:
            continue
        named[run.ops[0]] = (run, function)
    return UNIT.join(parts) + "\n", named


def slice_members(sliced: Mapping[str, tuple[SliceRun, str]]) -> set[str]:
    """The ops the compiled sliced kernels ``sliced`` (``sliced_source``) compute."""
    return {name for run, _ in sliced.values() for name in run.ops}


def graph_entry(
    graph: Graph,
    functions: Mapping[str, str],
    nests: Mapping[str, tuple[Nest, str]] | None = None,
    sliced: Mapping[str, tuple[SliceRun, str]] | None = None,
) -> str:
    """C function ``nf_run_graph(b)`` calling the kernel of every op of ``graph`` in
    order, tensor ``name`` at ``b[tensor_slots(graph)[name]]``: a whole run in one call.
    The ops of a nest are one call of its function (``nests``: by the nest's first op,
    the nest and its function's name), so are those of a sliced kernel (``sliced``:
    by its first op, the run and its function's name)."""
    slot = tensor_slots(graph)
    nests = nests or {}
    sliced = sliced or {}
    in_nests = {member.name for nest, _ in nests.values() for member in nest.members}
    in_nests |= slice_members(sliced)
    calls = []
    for op in graph.ops:
        if op.name in sliced:
            calls.append(f"    {sliced[op.name][1]}(b);")
            continue
        if op.name in nests:
            nest, function = nests[op.name]
            arguments = ", ".join(f"b[{slot[t.name]}]" for t in (*nest.outputs, *nest.inputs))
            calls.append(f"    {function}({arguments});")
            continue
        if op.name in in_nests:
            continue
        arguments = ", ".join(f"b[{slot[name]}]" for name in [op.name, *(t.name for t in op.inputs)])
        calls.append(f"    {functions[op.name]}({arguments});")
    return "void nf_run_graph(void *const *b) {\n" + "\n".join(calls) + "\n}\n"


def data_address(array: np.ndarray) -> int:
    """The address of a C-contiguous ``array``'s data: through the buffer protocol where
    it is writable (a third of the time of numpy's ``ctypes.data``, which a small
    model's step pays for each of its inputs), else through numpy."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    except (TypeError, ValueError):  # read-only, or empty
        return array.ctypes.data


@dataclass
class _RecycledBlock:
    """One of the two blocks of kept tensors a ``CpuExecutor``'s recycled runs write in
    turn: the block, its arrays by name, the slot pointers of a run writing it (the
    arena's and the block's filled in, the inputs' as its last run found them), and
    per input the array that run was given (``seen``) and the one it read (``held``)."""

    memory: np.ndarray
    outputs: dict[str, np.ndarray]
    pointers: np.ndarray
    seen: list[np.ndarray | None]
    held: list[np.ndarray | None]


class CpuExecutor:
    """Runs ``graph`` as compiled C kernels (ops without a C lowering run in the
    interpreter and are listed in ``interpreted``), freeing tensors by ``plan``.
    When every op has a kernel, a run is one call into the library: the
    intermediates live in one arena per run at the plan's offsets and the kept
    tensors in arrays of their own."""

    target = "cpu"

    def __init__(
        self,
        graph: Graph,
        keep: Collection[str],
        groups: Collection[Collection[str]] = (),
        sliced: Collection[SliceRun] = (),
    ) -> None:
        self.graph = graph
        self.keep = tuple(dict.fromkeys(keep))
        # a fusion plan's sliced kernels run slice by slice, each one call
        sliced_c, self._sliced_functions = sliced_source(graph, sliced)
        in_slices = slice_members(self._sliced_functions)
        self.source, names, self.interpreted = module_source(graph, in_slices)
        if self.interpreted:  # a run op by op: every op its own kernel
            self._sliced_functions, in_slices = {}, set()
            self.source, names, self.interpreted = module_source(graph)
        # a fusion plan's kernel of several ops runs as one loop nest where they make one
        unsliced = [group for group in groups if in_slices.isdisjoint(group)]
        self.nests = graph_nests(graph, unsliced, self.keep) if not self.interpreted else {}
        together = [[member.name for member in nest.members] for nest in self.nests.values()]
        together += [run.ops for run, _ in self._sliced_functions.values()]
        unstored = [name for nest in self.nests.values() for name in nest.buffered]
        unstored += [name for run, _ in self._sliced_functions.values() for name in run.private]
        self.plan: MemoryPlan = plan_memory(graph, self.keep, together, unstored)
        if not self.interpreted:
            nests_c, self._nest_functions = nest_source(self.nests)
            self.source += UNIT + nests_c + UNIT + sliced_c + UNIT
            self.source += graph_entry(graph, names, self._nest_functions, self._sliced_functions)
        self.library_path = build_library(self.source)
        self._function_names = names
        self._load_library()
        slots = tensor_slots(graph)
        produced = {op.name: op for op in graph.ops}
        self._input_slots = [(t.name, slots[t.name], dt.numpy_dtype(t.dtype)) for t in graph.inputs]
        self._kept_slots = [
            (name, slots[name], produced[name].shape, dt.numpy_dtype(produced[name].dtype))
            for name in self.keep
            if name in produced
        ]
        arena = [name for name in self.plan.offsets if name in slots and name not in self.keep]
        self._arena_slots = np.array([slots[name] for name in arena], dtype=np.intp)
        self._arena_offsets = np.array([self.plan.offsets[name] for name in arena], dtype=np.uintp)
        self._arena: np.ndarray | None = None
        self._arena_pointers: np.ndarray | None = None  # the slots with the reused arena's addresses filled in
        self._arena_lock = threading.Lock()
        self._slot_count = len(slots)
        # the kept tensors of a run share one block, each at an aligned offset of its own
        self._kept_offsets, self._kept_bytes = [], 0
        for _, _, shape, dtype in self._kept_slots:
            self._kept_offsets.append(self._kept_bytes)
            self._kept_bytes += aligned_size(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        self._recycled: list[_RecycledBlock] = []  # the two blocks recycled runs write in turn
        self._recycle_turn = 0

    def own_kernels(self) -> list[Op]:
        """The ops that run as a kernel of their own (not inside a loop nest or a sliced kernel), in
        graph order: what ``neoflow tune`` measures."""
        together = {member.name for nest in self.nests.values() for member in nest.members}
        together |= slice_members(self._sliced_functions)
        return [op for op in self.graph.ops if op.name in self._function_names and op.name not in together]

    def _load_library(self) -> None:
        """Load the compiled library (rebuilt from the source where the kernel cache lost it) and bind
        its functions; a fresh arena and fresh recycled blocks."""
        self.library_path = build_library(self.source)  # the cached one where it is whole
        self.library = ctypes.CDLL(str(self.library_path))
        self.library.nf_set_threads(ctypes.c_int(threads()))
        self.kernels = {}
        for op in self.graph.ops:
            if op.name in self._function_names:
                function = getattr(self.library, self._function_names[op.name])
                function.argtypes = [ctypes.c_void_p] * (1 + len(op.inputs))
                function.restype = None
                self.kernels[op.name] = function
        self.entry = None
        if not self.interpreted:
            self.entry = self.library.nf_run_graph
            self.entry.argtypes = [ctypes.c_void_p]
            self.entry.restype = None

    _UNPICKLED = ("library", "kernels", "entry", "_arena", "_arena_pointers", "_arena_lock", "_recycled")

    def __getstate__(self) -> dict:
        """What a compile cache stores: everything but the loaded library and the run-time buffers."""
        return {k: v for k, v in self.__dict__.items() if k not in self._UNPICKLED}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._arena = self._arena_pointers = None
        self._arena_lock = threading.Lock()
        self._recycled, self._recycle_turn = [], 0
        self._load_library()

    def sanitizer_program(self) -> str:
        """This executor's own module (the kernels, nests and sliced kernels it runs) as a standalone
        program for an AddressSanitizer/UBSan build (``sanitizer_main``)."""
        if self.interpreted:
            raise CompileError(f"ops without a C lowering: {', '.join(self.interpreted)}")
        return self.source + UNIT + sanitizer_main(self.graph)

    def artifacts(self) -> dict[str, bytes]:
        """What a build directory keeps of this executor, by file suffix: the C and its library."""
        return {".c": self.source.encode(), ".so": self.library_path.read_bytes()}

    def run(self, inputs: Mapping[str, np.ndarray], recycle: bool = False) -> dict[str, np.ndarray]:
        """The kept tensors by name, from every graph input by name (checked by the caller).
        The intermediates' arena is allocated once and reused by every run (a fresh one
        faults its pages in again each step, as much time as a light kernel takes); a run
        while another thread's holds it gets an arena of its own.

        With ``recycle`` the kept tensors are written into one of two blocks the executor
        keeps, taken in turn, and the arrays returned stay valid only until the run after
        next: a training step's next parameters, which the next step reads and its own
        results replace.  Such a run allocates nothing, and an input given as the very
        array (contiguous, of its dtype) it was given two runs before keeps the address
        found then: a small model's step spends more time making arrays and finding
        addresses than computing."""
        if self.entry is None:
            return run_graph(self, inputs)
        recycled = (lambda: self._run_recycled(inputs)) if recycle else None
        return self._in_arena(lambda pointers: self._run_in(pointers, inputs), recycled)

    @property
    def addressable(self) -> bool:
        """Whether ``run_at`` can run the graph (every op has a C kernel)."""
        return self.entry is not None

    @property
    def input_names(self) -> list[str]:
        """The graph's inputs in the order ``run_at`` takes their addresses."""
        return [name for name, _, _ in self._input_slots]

    @property
    def output_specs(self) -> list[tuple[str, tuple[int, ...], np.dtype]]:
        """The computed kept tensors (name, shape, dtype) in the order ``run_at`` takes their addresses."""
        return [(name, shape, dtype) for name, _, shape, dtype in self._kept_slots]

    def run_at(self, inputs: Sequence[int], outputs: Sequence[int]) -> None:
        """One run reading each input at its address and writing each computed kept tensor to its
        address (``input_names``, ``output_specs`` orders): C-contiguous memory of the graph's shapes
        and dtypes, 64-byte aligned outputs, all owned and kept alive by the caller — a framework's own
        tensors, with no array made per run (a small op's call otherwise spends as long making and
        checking arrays as computing).  Only where ``addressable``."""

        def run(pointers: np.ndarray) -> None:
            for (_, slot, _), address in zip(self._input_slots, inputs, strict=True):
                pointers[slot] = address
            for (_, slot, _, _), address in zip(self._kept_slots, outputs, strict=True):
                pointers[slot] = address
            self.entry(pointers.ctypes.data)

        self._in_arena(run)

    def _in_arena(self, run: Callable[[np.ndarray], T], recycled: Callable[[], T] | None = None) -> T:
        """``run(pointers)`` with the intermediates' slots of ``pointers`` in the reused arena (its
        lock held), or in a fresh arena while another thread's run holds that one; ``recycled()``
        instead where given and the reused arena is free."""
        if not self._arena_lock.acquire(blocking=False):
            _own_arena, start = aligned_buffer(self.plan.arena_bytes)  # alive until the run returns
            return run(self._slot_pointers(start))
        try:
            if self._arena is None:
                self._arena, start = aligned_buffer(self.plan.arena_bytes)
                self._arena_pointers = self._slot_pointers(start)
            if recycled is not None:
                return recycled()
            return run(self._arena_pointers.copy())
        finally:
            self._arena_lock.release()

    def _run_recycled(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``run`` with ``recycle``, the arena lock held."""
        if not self._recycled:
            self._recycled = [self._recycled_block() for _ in range(2)]
        block = self._recycled[self._recycle_turn]
        self._recycle_turn = 1 - self._recycle_turn
        self._point_to_inputs(block.pointers, inputs, block.seen, block.held)
        self.entry(block.pointers.ctypes.data)
        return self._handed_back(block.outputs, inputs)

    def _recycled_block(self) -> _RecycledBlock:
        """A block for recycled runs, with its slot pointers (the arena's filled in)."""
        pointers = self._arena_pointers.copy()
        memory, outputs = self._kept_block(pointers)
        count = len(self._input_slots)
        return _RecycledBlock(memory, outputs, pointers, [None] * count, [None] * count)

    def _slot_pointers(self, arena: int) -> np.ndarray:
        """Every tensor slot's pointer, the intermediates' at their offsets in the arena
        at address ``arena``, the others zero."""
        pointers = np.zeros(self._slot_count, dtype=np.uintp)
        pointers[self._arena_slots] = arena + self._arena_offsets
        return pointers

    def _run_in(self, pointers: np.ndarray, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``run`` with the intermediates' slots of ``pointers`` filled in."""
        count = len(self._input_slots)
        held: list[np.ndarray | None] = [None] * count  # the inputs as the kernels read them, alive until it returns
        self._point_to_inputs(pointers, inputs, [None] * count, held)
        _block, outputs = self._kept_block(pointers)
        self.entry(pointers.ctypes.data)
        return self._handed_back(outputs, inputs)

    def _point_to_inputs(
        self,
        pointers: np.ndarray,
        inputs: Mapping[str, np.ndarray],
        seen: list[np.ndarray | None],
        held: list[np.ndarray | None],
    ) -> None:
        """Set the input slots of ``pointers`` to ``inputs``, each as a contiguous array of
        its dtype kept alive in ``held``; an input that is the very array ``seen`` holds for
        it is skipped (its slot points to it already).  ``seen`` then holds each input that
        needed no conversion: a converted copy is not remembered, as the caller may change
        the array it copies."""
        for k, (name, slot, dtype) in enumerate(self._input_slots):
            value = inputs[name]
            if value is seen[k]:
                continue
            array = np.ascontiguousarray(value, dtype=dtype)
            pointers[slot] = data_address(array)
            seen[k] = value if array is value else None
            held[k] = array

    def _kept_block(self, pointers: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """A new block for a run's kept tensors and their arrays in it by name; their
        slots of ``pointers`` are set to those arrays."""
        block, start = aligned_buffer(self._kept_bytes)
        outputs = {}
        for (name, slot, shape, dtype), offset in zip(self._kept_slots, self._kept_offsets, strict=True):
            outputs[name] = np.ndarray(shape, dtype, buffer=block, offset=offset)
            pointers[slot] = start + offset
        return block, outputs

    def _handed_back(self, outputs: Mapping[str, np.ndarray], inputs: Mapping[str, np.ndarray]) -> dict:
        """What a run returns: each kept tensor by name, computed or (kept inputs) given."""
        return {name: outputs[name] if name in outputs else inputs[name] for name in self.keep}

    def run_op(self, op: Op, values: Mapping[str, np.ndarray]) -> np.ndarray:
        """The value of ``op`` (one of the graph's) from its inputs' ``values``."""
        return self.op_call(op, values)()

    def op_call(self, op: Op, values: Mapping[str, np.ndarray]) -> Callable[[], np.ndarray]:
        """A call computing ``op`` from ``values`` again and again (for timing it alone): the
        inputs are converted and the output allocated once, each call runs only the kernel
        (an op without one is evaluated by the interpreter each time)."""
        kernel = self.kernels.get(op.name)
        if kernel is None:
            return lambda: evaluate_op(op, {name: values[name] for name in op.input_names})
        args = [np.ascontiguousarray(values[t.name], dtype=dt.numpy_dtype(t.dtype)) for t in op.inputs]
        out = np.empty(op.shape, dt.numpy_dtype(op.dtype))
        pointers = (out.ctypes.data, *(a.ctypes.data for a in args))

        def call(converted: list = args) -> np.ndarray:  # holds the converted inputs the pointers point into
            kernel(*pointers)
            return out

        return call

    def _sliced_call(self, run: SliceRun, function_name: str, values: Mapping[str, np.ndarray]) -> Callable[[], dict]:
        """``kernel_call`` for a sliced kernel: one call of its function, returning what it stores."""
        function = getattr(self.library, function_name)
        function.argtypes = [ctypes.c_void_p]
        function.restype = None
        slots = tensor_slots(self.graph)
        ops = [self.graph.op(name) for name in run.ops]
        args = {
            t.name: np.ascontiguousarray(values[t.name], dtype=dt.numpy_dtype(t.dtype))
            for op in ops
            for t in op.inputs
            if t.name not in run.ops
        }
        outs = {op.name: np.empty(op.shape, dt.numpy_dtype(op.dtype)) for op in ops if op.name not in run.private}
        pointers = np.zeros(self._slot_count, dtype=np.uintp)
        for name, array in (*args.items(), *outs.items()):
            pointers[slots[name]] = array.ctypes.data

        def call(converted: dict = args) -> dict:  # holds the converted inputs the pointers point into
            function(pointers.ctypes.data)
            return outs

        return call

    def kernel_call(self, names: Collection[str], values: Mapping[str, np.ndarray]) -> Callable[[], dict]:
        """A call computing the ops ``names`` (one kernel of the fusion plan, in
        order) from ``values`` again and again, returning their values by name: one
        call of the sliced kernel's or the nest's function where they run as one,
        else each op's ``op_call`` in turn."""
        names = list(names)
        sliced = self._sliced_functions.get(names[0]) if names else None
        if sliced is not None and list(sliced[0].ops) == names:
            return self._sliced_call(*sliced, values)
        nest = self.nests.get(names[0]) if names else None
        if nest is None or [member.name for member in nest.members] != names:
            return sequential_call(self, names, values)
        function = getattr(self.library, self._nest_functions[names[0]][1])
        function.argtypes = [ctypes.c_void_p] * (len(nest.outputs) + len(nest.inputs))
        function.restype = None
        args = [np.ascontiguousarray(values[t.name], dtype=dt.numpy_dtype(t.dtype)) for t in nest.inputs]
        outs = {t.name: np.empty(t.shape, dt.numpy_dtype(t.dtype)) for t in nest.outputs}
        pointers = (*(a.ctypes.data for a in outs.values()), *(a.ctypes.data for a in args))

        def call(converted: list = args) -> dict:  # holds the converted inputs the pointers point into
            function(*pointers)
            return outs

        return call


def sanitizer_program(graph: Graph, groups: Collection[Collection[str]] = (), sliced: Collection[SliceRun] = ()) -> str:
    """A standalone C program running ``graph`` through ``nf_run_graph`` (every
    kernel in order, the ``groups`` that make loop nests as nests, the ``sliced``
    kernels slice by slice) on buffers of exactly each tensor's size (inputs
    filled with small deterministic values, integer inputs with 0), for building
    with ``-fsanitize=address,undefined``: any out-of-bounds access or undefined
    behaviour in generated code shows up when it runs."""
    sliced_c, sliced_functions = sliced_source(graph, sliced)
    in_slices = slice_members(sliced_functions)  # a run that does not compile runs op by op
    source, functions, interpreted = module_source(graph, in_slices)
    if interpreted:
        raise CompileError(f"ops without a C lowering: {', '.join(interpreted)}")
    nests_c, nests = nest_source(graph_nests(graph, [group for group in groups if in_slices.isdisjoint(group)]))
    entry = graph_entry(graph, functions, nests, sliced_functions)
    return UNIT.join([source, nests_c, sliced_c, entry, sanitizer_main(graph)])


def sanitizer_main(graph: Graph) -> str:
    """The ``main`` of a sanitizer program (``sanitizer_program``): every tensor in a buffer of exactly
    its size, the inputs filled, one ``nf_run_graph``, a checksum of the outputs printed."""
    from neoflow.codegen.c_expr import c_type

    lines = ["#include <stdio.h>", "int main(void) {", "    uint64_t seed = 1;"]
    buffers = {}
    for tensor_name, k in tensor_slots(graph).items():
        tensor = graph.tensors[tensor_name]
        name = f"b{k}"
        buffers[tensor.name] = name
        ctype = c_type(tensor.dtype)
        lines.append(f"    {ctype} *{name} = ({ctype} *)malloc(sizeof({ctype}) * {max(tensor.size, 1)});")
        if tensor.name in {t.name for t in graph.inputs}:
            fill = "0" if not tensor.dtype.startswith("float") else "(float)((seed >> 33) % 2000) / 1000.0f - 1.0f"
            lines.append(
                f"    for (int64_t i = 0; i < {tensor.size}; ++i) {{ seed = seed * 6364136223846793005ULL + 1; "
                f"{name}[i] = {fill}; }}"
            )
    lines.append(f"    void *slots_[] = {{{', '.join(buffers.values())}}};")
    lines.append("    nf_run_graph(slots_);")
    lines.append("    double checksum = 0;")
    for name in graph.outputs:
        size = graph.tensors[name].size
        lines.append(f"    for (int64_t i = 0; i < {size}; ++i) checksum += (double){buffers[name]}[i];")
    lines += [f"    free({b});" for b in buffers.values()]
    lines += ['    printf("checksum %g\\n", checksum);', "    return 0;", "}"]
    return "\n".join(lines) + "\n"
