"""Measured tuning of the cpu target's kernels: per kernel, the lowering path and the blocked kernel's
block sizes and structure that run fastest on this machine, found by timing them, kept on disk, used by
every later compile.

An op's kernel is named by the C its default lowering emits (``lower_op`` with no choice: it holds the
op's shapes, index maps and expressions), so ops that compile to the same code share one result.  The
results of one machine — its processor, cores, the thread count kernels run with and the compiler
with its flags — live in ``$NEOFLOW_CACHE_DIR/tuning/cpu-<machine>.json``, written atomically.  Without
an entry an op compiles as it always did; ``NEOFLOW_TUNING=0`` ignores the table (``targets.cache``).

The search (``tune_op``) starts from the default, tries every other path that can compute the op, and
on the blocked kernel walks its structure, depth block and row block one at a time, keeping a change
only when it is measurably faster (``MARGIN``); each candidate's output must match the default's before
its time counts.  Timings take turns in blocks of consecutive calls, the candidate against the best so
far, and compare medians.
"""

from __future__ import annotations

import _ctypes
import ctypes
import dataclasses
import hashlib
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from neoflow.codegen.hardware import cpu_model
from neoflow.errors import CompileError
from neoflow.ir import dtypes as dt
from neoflow.ir.op import Op
from neoflow.targets.cache import cache_dir, read_table, tuning_enabled, update_table
from neoflow.targets.cache import table_digest as file_digest
from neoflow.targets.cpu.compiler import build_library, compiler, version
from neoflow.targets.cpu.gemm import DEFAULT_BLOCKING, MICROKERNEL, STRUCTURES, Blocking
from neoflow.targets.cpu.lower import KernelChoice, lower_op, lowering_paths
from neoflow.targets.cpu.prelude import PRELUDE

#: bump when the meaning of an entry changes: older tables are then ignored
TUNING_VERSION = 1
#: a candidate must be this much faster than the best so far to replace it (timing noise on a shared machine)
MARGIN = 0.97
#: the depth blocks and row blocks tried on the blocked kernel (the defaults are 256 and 96)
DEPTH_BLOCKS = (128, 192, 384, 512)
ROW_BLOCKS = (48, 144, 192)
#: rounds of blocks of consecutive calls per comparison, and the time a block aims at
ROUNDS, BLOCK_SECONDS = 3, 0.03
#: the function name tuned kernels are compiled under
FUNCTION = "nf_tuned"


def machine_key(threads: int) -> str:
    """The key of this machine's table: processor, cores, ``threads``, compiler and its version."""
    return _machine_key(threads, compiler())


@cache
def _machine_key(threads: int, command: str) -> str:
    text = f"{TUNING_VERSION}/{cpu_model()}/{os.cpu_count()}/{threads}/{command}/{version(command)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def table_path(threads: int) -> Path:
    """Where this machine's results are kept."""
    return cache_dir() / "tuning" / f"cpu-{machine_key(threads)}.json"


def kernel_key(default_code: str) -> str:
    """The key of a kernel: a hash of the C its default lowering emits."""
    return hashlib.sha256(default_code.encode()).hexdigest()[:32]


def load_table(threads: int) -> dict[str, dict]:
    """This machine's entries by kernel key (empty where none were measured or the file is damaged)."""
    return read_table(table_path(threads))


def table_digest(threads: int) -> str:
    """A hash of the table compiles would use now (``off`` where tuning is ignored)."""
    return file_digest(table_path(threads))


def choice_of(entry: dict) -> KernelChoice:
    """The choice an entry of the table records."""
    blocking = Blocking(
        int(entry.get("kc", DEFAULT_BLOCKING.kc)),
        int(entry.get("mc", DEFAULT_BLOCKING.mc)),
        int(entry.get("nc", DEFAULT_BLOCKING.nc)),
        str(entry.get("structure", "auto")),
    )
    return KernelChoice(str(entry.get("path", "auto")), blocking)


def tuned_choice(default_code: str, threads: int) -> KernelChoice | None:
    """The measured choice for the kernel whose default C is ``default_code``; None where there is
    none, it is the default, or tuning is off."""
    if not tuning_enabled():
        return None
    entry = load_table(threads).get(kernel_key(default_code))
    if entry is None:
        return None
    try:
        choice = choice_of(entry)
    except (TypeError, ValueError):
        return None  # an entry this version cannot read: the default
    return None if choice == KernelChoice() else choice


def record(results: Sequence[TuneResult], threads: int) -> Path:
    """Add ``results`` to this machine's table."""
    path = table_path(threads)
    entries = {}
    for result in results:
        choice = result.choice
        entries[result.key] = {
            "path": choice.path,
            "kc": choice.blocking.kc,
            "mc": choice.blocking.mc,
            "nc": choice.blocking.nc,
            "structure": choice.blocking.structure,
            "seconds": result.seconds,
            "default_seconds": result.default_seconds,
            "op": result.op,
        }
    update_table(path, entries)
    return path


@dataclass(frozen=True)
class TuneResult:
    """What tuning one kernel found: the op it was tuned on, its key, the default's and the chosen
    choice's median seconds, the candidates timed and those whose output did not match."""

    op: str
    key: str
    choice: KernelChoice
    default_seconds: float
    seconds: float
    tried: int
    rejected: tuple[str, ...] = ()


def describe(choice: KernelChoice) -> str:
    """A choice in a few words (``default`` for the untuned lowering)."""
    if choice == KernelChoice():
        return "default"
    words = [choice.path]
    blocking = choice.blocking
    if choice.path in ("auto", "blocked") and blocking != DEFAULT_BLOCKING:
        words.append(f"{blocking.structure} kc={blocking.kc} mc={blocking.mc}")
    return " ".join(words)


class _Candidate:
    """One choice compiled alone into a library of its own, with a call on fixed inputs."""

    def __init__(self, op: Op, choice: KernelChoice, code: str, inputs: Sequence[np.ndarray]) -> None:
        self.choice = choice
        source = f"{PRELUDE}\n{MICROKERNEL}\n{code.replace('KERNEL', FUNCTION)}\n"
        self.library = ctypes.CDLL(str(build_library(source)))
        self.function = getattr(self.library, FUNCTION)
        self.function.argtypes = [ctypes.c_void_p] * (1 + len(inputs))
        self.function.restype = None
        self.out = np.empty(op.shape, dt.numpy_dtype(op.dtype))
        self.inputs = inputs
        self.pointers = (self.out.ctypes.data, *(a.ctypes.data for a in inputs))

    def __call__(self) -> np.ndarray:
        self.function(*self.pointers)
        return self.out

    def close(self) -> None:
        """Unload the library (its thread key and code given back: a search loads hundreds)."""
        handle, self.library, self.function = self.library._handle, None, None
        _ctypes.dlclose(handle)


def _calls_per_block(call: Callable[[], object]) -> int:
    start = time.perf_counter()
    call()
    once = max(time.perf_counter() - start, 1e-6)
    return max(2, min(200, int(BLOCK_SECONDS / once)))


def compare(first: Callable[[], object], second: Callable[[], object], rounds: int = ROUNDS) -> tuple[float, float]:
    """The median seconds a call of ``first`` and of ``second`` take, timed in ``rounds`` rounds of
    blocks of consecutive calls, the two taking turns block by block."""
    first(), second()  # warm: pages touched, threads started
    calls = max(_calls_per_block(first), _calls_per_block(second))
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for call, found in ((first, times[0]), (second, times[1])):
            for _ in range(calls):
                start = time.perf_counter()
                call()
                found.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def _matches(expected: np.ndarray, found: np.ndarray) -> bool:
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    return bool(np.allclose(found, expected, rtol=1e-4, atol=1e-5 * max(scale, 1.0), equal_nan=True))


#: a structure whose default blocking is this much slower than the best so far is not walked further
PROMISING = 1.3


def _walk(structure: str, best: KernelChoice) -> list[list[KernelChoice]]:
    """The steps of the walk over ``structure``'s block sizes: its depth blocks, then its row blocks
    (from the depth block of ``best`` where ``best`` has this structure: called again after the first step)."""
    start = best.blocking if best.blocking.structure == structure else Blocking(structure=structure)
    depths = [dataclasses.replace(start, kc=kc) for kc in DEPTH_BLOCKS if kc != start.kc]
    rows = [dataclasses.replace(start, mc=mc) for mc in ROW_BLOCKS if mc != start.mc]
    return [[KernelChoice("blocked", b) for b in depths], [KernelChoice("blocked", b) for b in rows]]


def tune_op(
    op: Op, inputs: Sequence[np.ndarray], deadline: float | None = None, default_code: str | None = None
) -> TuneResult:
    """The fastest choice found for ``op`` (its ``inputs`` as arrays of its input tensors' types)
    before ``deadline`` (``time.perf_counter()``; None: the whole walk)."""
    inputs = [np.ascontiguousarray(a, dtype=dt.numpy_dtype(t.dtype)) for a, t in zip(inputs, op.inputs, strict=True)]
    default_code = default_code if default_code is not None else lower_op(op, "KERNEL")
    key = kernel_key(default_code)
    default = _Candidate(op, KernelChoice(), default_code, inputs)
    expected = default().copy()
    best, tried, rejected = default, 1, []
    best_seconds = default_seconds = None
    seen = {default_code}

    def attempt(choice: KernelChoice) -> float | None:
        """Time ``choice`` against the best so far (taking it where faster): its median seconds,
        None where it was not timed (past the deadline, its code seen already, wrong output)."""
        nonlocal best, best_seconds, default_seconds, tried
        if deadline is not None and time.perf_counter() > deadline:
            return None
        try:
            code = lower_op(op, "KERNEL", choice)
        except CompileError:
            return None  # a path this op's shapes cannot take after all
        if code in seen:
            return None
        seen.add(code)
        candidate = _Candidate(op, choice, code, inputs)
        tried += 1
        if not _matches(expected, candidate()):
            rejected.append(describe(choice))
            candidate.close()
            return None
        incumbent, challenger = compare(best, candidate)
        if default_seconds is None:
            default_seconds = incumbent
        best_seconds = incumbent if best_seconds is None else min(best_seconds, incumbent)
        if challenger < MARGIN * incumbent:
            if best is not default:
                best.close()
            best, best_seconds = candidate, challenger
        else:
            candidate.close()
        return challenger

    try:
        paths = lowering_paths(op)
        for path in paths:
            attempt(KernelChoice(path))
        if "blocked" in paths:
            for structure in STRUCTURES:
                base = KernelChoice("blocked", Blocking(structure=structure))
                seconds = attempt(base)
                promising = seconds is not None and best_seconds is not None and seconds <= PROMISING * best_seconds
                if promising or lower_op(op, "KERNEL", base) == default_code:  # the default's own structure
                    for step in range(2):
                        for choice in _walk(structure, best.choice)[step]:
                            attempt(choice)
        if best is default:
            if default_seconds is None:  # nothing else was timed: the default alone
                default_seconds = compare(default, default, rounds=1)[0]
            return TuneResult(op.name, key, KernelChoice(), default_seconds, default_seconds, tried, tuple(rejected))
        # the winner against the default head to head, in more rounds: kept only where still faster
        default_seconds, best_seconds = compare(default, best, rounds=2 * ROUNDS)
        if best_seconds >= MARGIN * default_seconds:
            return TuneResult(op.name, key, KernelChoice(), default_seconds, default_seconds, tried, tuple(rejected))
        return TuneResult(op.name, key, best.choice, default_seconds, best_seconds, tried, tuple(rejected))
    finally:  # every library unloaded: a search loads hundreds
        default.close()
        if best is not default:
            best.close()
