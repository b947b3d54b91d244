"""Measures the machine for the fusion cost model with generated C: FMA peak, a
scalar and a vectorised loop's rates, bandwidth from memory and from the
last-level cache, and the cost of one kernel call.

Measured once per machine, compiler and thread count; the figures are cached
as JSON beside the compiled kernels."""

from __future__ import annotations

import ctypes
import hashlib
import json
import time
from functools import cache

import numpy as np

from neoflow.codegen.hardware import AVX2
from neoflow.fusion.cost import Machine
from neoflow.targets.cache import cache_dir
from neoflow.targets.cpu.compiler import build_library

PROBE_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
/* the widest vector the micro-kernel uses (targets/cpu/gemm.py): zmm with AVX-512, else ymm */
#if defined(__AVX512F__)
typedef __m512 nf_vector;
#define NF_LANES 16
#define NF_SET1 _mm512_set1_ps
#define NF_FMA _mm512_fmadd_ps
#define NF_ADD _mm512_add_ps
#define NF_STORE _mm512_storeu_ps
#else
typedef __m256 nf_vector;
#define NF_LANES 8
#define NF_SET1 _mm256_set1_ps
#define NF_FMA _mm256_fmadd_ps
#define NF_ADD _mm256_add_ps
#define NF_STORE _mm256_storeu_ps
#endif
double nf_fma_peak(long n) {
    double start = omp_get_wtime();
    float sink = 0;
    #pragma omp parallel reduction(+:sink)
    {
        /* twelve chains with different values: equal ones would be merged into one
           chain by the compiler, which then runs at the FMA's latency, not its rate */
        nf_vector a0 = NF_SET1(1.00f), a1 = NF_SET1(1.01f), a2 = NF_SET1(1.02f), a3 = NF_SET1(1.03f);
        nf_vector a4 = NF_SET1(1.04f), a5 = NF_SET1(1.05f), a6 = NF_SET1(1.06f), a7 = NF_SET1(1.07f);
        nf_vector a8 = NF_SET1(1.08f), a9 = NF_SET1(1.09f), a10 = NF_SET1(1.10f), a11 = NF_SET1(1.11f);
        const nf_vector x = NF_SET1(0.9999999f), y = NF_SET1(1e-7f);
        for (long i = 0; i < n; ++i) {
            a0 = NF_FMA(a0, x, y); a1 = NF_FMA(a1, x, y); a2 = NF_FMA(a2, x, y); a3 = NF_FMA(a3, x, y);
            a4 = NF_FMA(a4, x, y); a5 = NF_FMA(a5, x, y); a6 = NF_FMA(a6, x, y); a7 = NF_FMA(a7, x, y);
            a8 = NF_FMA(a8, x, y); a9 = NF_FMA(a9, x, y); a10 = NF_FMA(a10, x, y); a11 = NF_FMA(a11, x, y);
        }
        nf_vector s = NF_ADD(NF_ADD(NF_ADD(a0, a1), NF_ADD(a2, a3)), NF_ADD(NF_ADD(a4, a5), NF_ADD(a6, a7)));
        s = NF_ADD(s, NF_ADD(NF_ADD(a8, a9), NF_ADD(a10, a11)));
        float lanes[NF_LANES];
        NF_STORE(lanes, s);
        sink += lanes[0];
    }
    double seconds = omp_get_wtime() - start;
    return sink > 0 ? 2.0 * NF_LANES * 12 * (double)n * omp_get_max_threads() / seconds : 0;
}
/* a generic loop nest's arithmetic: a guarded, index-computing element-wise op */
double nf_loop_rate(float *out, const float *in, long n, int reps) {
    double start = omp_get_wtime();
    for (int r = 0; r < reps; ++r) {
        #pragma omp parallel for
        for (long i = 0; i < n; ++i) {
            long j = (i * 7 + r) % n;
            out[i] = (j > 2 ? in[j] * 0.5f + out[i] : 1.0f) * 0.25f + 1.0f;
        }
    }
    return 5.0 * (double)n * reps / (omp_get_wtime() - start);
}
/* a loop the compiler runs in vector lanes: an element-wise update */
double nf_vector_rate(float *out, const float *in, long n, int reps) {
    double start = omp_get_wtime();
    for (int r = 0; r < reps; ++r) {
        #pragma omp parallel for
        for (long i = 0; i < n; ++i) out[i] = out[i] * 0.999f + in[i] * 0.5f;
    }
    return 3.0 * (double)n * reps / (omp_get_wtime() - start);
}
/* streaming bandwidth: out = a * 2 + b, bytes read and written */
double nf_bandwidth(float *out, const float *a, const float *b, long n, int reps) {
    double start = omp_get_wtime();
    for (int r = 0; r < reps; ++r) {
        #pragma omp parallel for
        for (long i = 0; i < n; ++i) out[i] = a[i] * 2.0f + b[i];
    }
    return 12.0 * (double)n * reps / (omp_get_wtime() - start);
}
void nf_empty(float *out) { out[0] = 0; }
"""


def _last_level_cache() -> float:
    """The last-level cache's size in bytes (the code generator's hardware description)."""
    return float(AVX2.scope("L3").capacity)


@cache
def measure_machine(threads: int) -> Machine:
    """This machine's figures for ``threads`` threads (cached on disk)."""
    path = build_library(PROBE_SOURCE)
    key = hashlib.sha256(f"{path.name}/{threads}/{sorted(Machine.__dataclass_fields__)}".encode()).hexdigest()[:16]
    record = cache_dir() / "machine" / f"{key}.json"
    if record.is_file():
        try:
            return Machine(**json.loads(record.read_text()), measured=True, threads=threads)
        except (TypeError, ValueError):
            pass  # a damaged record: measure again and rewrite it
    library = ctypes.CDLL(str(path))
    library.omp_set_num_threads(ctypes.c_int(threads))
    double = ctypes.c_double
    library.nf_fma_peak.restype = library.nf_loop_rate.restype = library.nf_bandwidth.restype = double
    library.nf_vector_rate.restype = double
    library.nf_fma_peak.argtypes = [ctypes.c_long]
    pointer = ctypes.c_void_p
    library.nf_loop_rate.argtypes = [pointer, pointer, ctypes.c_long, ctypes.c_int]
    library.nf_vector_rate.argtypes = [pointer, pointer, ctypes.c_long, ctypes.c_int]
    library.nf_bandwidth.argtypes = [pointer, pointer, pointer, ctypes.c_long, ctypes.c_int]
    library.nf_empty.argtypes = [pointer]
    peak = max(library.nf_fma_peak(20_000_000) for _ in range(3))
    small = np.ones(1 << 16, np.float32)
    out_small = np.zeros_like(small)
    loop = max(library.nf_loop_rate(out_small.ctypes.data, small.ctypes.data, small.size, 200) for _ in range(3))
    vector = max(library.nf_vector_rate(out_small.ctypes.data, small.ctypes.data, small.size, 200) for _ in range(3))
    cache_bytes = _last_level_cache()
    big = [np.ones(max(1 << 23, int(cache_bytes)), np.float32) for _ in range(3)]  # 3 x 4 x the cache
    bandwidth = max(library.nf_bandwidth(*(b.ctypes.data for b in big), big[0].size, 4) for _ in range(3))
    # a quarter of the cache: tensors a kernel's producer has just written
    mid = [np.ones(int(cache_bytes) // 48, np.float32) for _ in range(3)]
    cached = max(library.nf_bandwidth(*(b.ctypes.data for b in mid), mid[0].size, 50) for _ in range(3))
    # one kernel call as an executor makes it: the output allocated, an input checked, the C function called
    calls = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(1000):
            out = np.empty(16, np.float32)
            np.ascontiguousarray(small, dtype=np.float32)
            library.nf_empty(out.ctypes.data)
        calls.append((time.perf_counter() - start) / 1000)
    figures = {
        "peak_flops": peak,
        "loop_flops": loop,
        "bandwidth": bandwidth,
        "call_seconds": min(calls),
        "vector_flops": vector,
        "cache_bandwidth": cached,
        "cache_bytes": cache_bytes,
    }
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(figures))
    return Machine(**figures, measured=True, threads=threads)
