"""Time the reference interpreter on the seed's full-size four-op graph.

python -m benchmarks.interpreter [--repeat 5]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import numpy as np

import neoflow

MODEL = Path(__file__).resolve().parents[1] / "models" / "four_op.nf"


def main() -> None:
    """Parse the graph once, evaluate it ``--repeat`` times, print the median."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    start = time.perf_counter()
    graph = neoflow.graph(MODEL.read_text())
    parse_time = time.perf_counter() - start
    rng = np.random.default_rng(0)
    inputs = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in graph.inputs}
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        neoflow.evaluate(graph, inputs)
        times.append(time.perf_counter() - start)
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(f"parse + range inference: {parse_time * 1e3:.1f} ms")
    print(
        f"interpreter, four-op graph at full size: median {statistics.median(times):.3f} s "
        f"over {args.repeat} runs (min {min(times):.3f} s, max {max(times):.3f} s)"
    )


if __name__ == "__main__":
    main()
