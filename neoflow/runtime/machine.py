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

from neoflow.codegen.compiler import build_library, cache_dir
from neoflow.codegen.hardware import AVX2
from neoflow.fusion.cost import Machine

PROBE_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
double nf_fma_peak(long n) {
    double start = omp_get_wtime();
    float sink = 0;
    #pragma omp parallel reduction(+:sink)
    {
        /* twelve chains with different values: equal ones would be merged into one
           chain by the compiler, which then runs at the FMA's latency, not its rate */
        __m256 a0 = _mm256_set1_ps(1.00f), a1 = _mm256_set1_ps(1.01f), a2 = _mm256_set1_ps(1.02f);
        __m256 a3 = _mm256_set1_ps(1.03f), a4 = _mm256_set1_ps(1.04f), a5 = _mm256_set1_ps(1.05f);
        __m256 a6 = _mm256_set1_ps(1.06f), a7 = _mm256_set1_ps(1.07f), a8 = _mm256_set1_ps(1.08f);
        __m256 a9 = _mm256_set1_ps(1.09f), a10 = _mm256_set1_ps(1.10f), a11 = _mm256_set1_ps(1.11f);
        const __m256 x = _mm256_set1_ps(0.9999999f), y = _mm256_set1_ps(1e-7f);
        for (long i = 0; i < n; ++i) {
            a0 = _mm256_fmadd_ps(a0, x, y); a1 = _mm256_fmadd_ps(a1, x, y); a2 = _mm256_fmadd_ps(a2, x, y);
            a3 = _mm256_fmadd_ps(a3, x, y); a4 = _mm256_fmadd_ps(a4, x, y); a5 = _mm256_fmadd_ps(a5, x, y);
            a6 = _mm256_fmadd_ps(a6, x, y); a7 = _mm256_fmadd_ps(a7, x, y); a8 = _mm256_fmadd_ps(a8, x, y);
            a9 = _mm256_fmadd_ps(a9, x, y); a10 = _mm256_fmadd_ps(a10, x, y); a11 = _mm256_fmadd_ps(a11, x, y);
        }
        __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                                 _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
        s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
        float lanes[8];
        _mm256_storeu_ps(lanes, s);
        sink += lanes[0];
    }
    double seconds = omp_get_wtime() - start;
    return sink > 0 ? 2.0 * 8 * 12 * (double)n * omp_get_max_threads() / seconds : 0;
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
            return Machine(**json.loads(record.read_text()), measured=True)
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
    return Machine(**figures, measured=True)
