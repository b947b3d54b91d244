"""Kernel temporaries in scratch blocks each calling thread keeps from one call to the next."""

from __future__ import annotations

import ctypes
import threading

import neoflow
from neoflow.targets.cpu.compiler import load_library
from neoflow.targets.cpu.lower import lower_op
from neoflow.targets.cpu.prelude import PRELUDE
from tests.on_targets import NEEDS_CC

PROBE = (
    PRELUDE
    + """
/* the scratch block of one site, of ``count`` floats, written through so that it is used */
void *probe(int64_t count) {
    NF_SCRATCH(float, block, count);
    for (int64_t i = 0; i < count; ++i) block[i] = (float)i;
    return block;
}
"""
)


@NEEDS_CC
def test_a_thread_gets_its_block_again_a_larger_one_when_asked_for_more_and_threads_their_own() -> None:
    library = load_library(PROBE)
    probe = library.probe
    probe.argtypes, probe.restype = [ctypes.c_int64], ctypes.c_void_p
    first = probe(1000)
    assert first % 64 == 0, "scratch blocks are aligned for vector loads"
    assert probe(1000) == first and probe(10) == first, "the same block for the same or a smaller size"
    larger = probe(100_000)
    assert larger != first and probe(50_000) == larger
    seen = []

    def other_thread() -> None:
        seen.append(probe(1000))

    threads = [threading.Thread(target=other_thread) for _ in range(2)]
    for thread in threads:
        thread.start()
        thread.join()  # one after the other: a finished thread's blocks are freed, not reused by accident
    assert all(address not in (first, larger) for address in seen), "each thread has its own block"


def test_kernels_keep_their_temporaries_in_scratch_blocks_and_free_none() -> None:
    # the dilated stride-2 convolution's input adjoint: staged sums, then lattice pieces
    staged = neoflow.grad(
        neoflow.op(
            "D[n, k, p, q] = ReduceAdd({r, s}, B[n, c, p*2+r*2, q*2+s*2] * C[k, c, r, s])",
            shapes={"B": (1, 3, 36, 36), "C": (32, 3, 3, 3)},
        )
    )["B"]
    blocked = neoflow.op("Y[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (96, 300), "B": (300, 80)})
    for op in (staged, blocked):
        code = lower_op(op, "kernel")
        assert "NF_SCRATCH(float, " in code, op.name
        assert "free(" not in code and "aligned_alloc(" not in code, op.name


@NEEDS_CC
def test_a_library_loaded_when_no_thread_key_is_left_keeps_its_blocks_and_python_works(tmp_path) -> None:
    # a tuner loads hundreds of libraries, each with a thread key for its blocks; a process has 1024
    # keys: where none is left, a library must not use another's key (Python's thread state broke)
    libc = ctypes.CDLL(None)
    keys = []
    while True:
        key = ctypes.c_uint()
        if libc.pthread_key_create(ctypes.byref(key), None) != 0:
            break
        keys.append(key)
    try:
        library = load_library(PROBE + "\n/* no key left */\n")
        probe = library.probe
        probe.argtypes, probe.restype = [ctypes.c_int64], ctypes.c_void_p
        first = probe(1000)
        assert first and probe(1000) == first
        found = []
        thread = threading.Thread(target=lambda: found.append(probe(1000)))
        thread.start()
        thread.join()
        assert found and found[0] != first
    finally:
        for key in keys:
            libc.pthread_key_delete(key)
    assert len(keys) > 100


@NEEDS_CC
def test_a_library_unloaded_gives_its_thread_key_back() -> None:
    import _ctypes

    from neoflow.targets.cpu.compiler import build_library

    path = str(build_library(PROBE + "\n/* loaded and unloaded */\n"))
    for _ in range(1100):  # more than a process's 1024 keys
        library = ctypes.CDLL(path)
        library.probe.argtypes, library.probe.restype = [ctypes.c_int64], ctypes.c_void_p
        thread = threading.Thread(target=library.probe, args=(16,))  # a thread of its own: a block, a key
        thread.start()
        thread.join()
        _ctypes.dlclose(library._handle)
    libc = ctypes.CDLL(None)
    key = ctypes.c_uint()
    assert libc.pthread_key_create(ctypes.byref(key), None) == 0, "no thread key left"
    libc.pthread_key_delete(key)
