"""Time deriving the adjoints of every op of a 50-op graph.

    python -m benchmarks.autodiff_speed

The graph is a small CNN-like chain of 50 ops (padding, strided and dilated
convolutions, depth-to-space, pooling, bias, activations, softmax pieces),
a mix that exercises every part of the derivation (quasi-affine steps,
lattice conditions, guards, max routing).
"""

from __future__ import annotations

import platform
import time

import neoflow
from neoflow.autodiff import grad

BLOCK = """
P{i}[n, c, h, w] = Select(h >= 1 && h < 17 && w >= 1 && w < 17, X{i}[n, c, h - 1, w - 1], 0)
V{i}[n, k, p, q] = ReduceAdd({{c, r, s}}, P{i}[n, c, p + r, q + s] * W{i}[k, c, r, s])
S{i}[n, k, p, q] = ReduceAdd({{c, r, s}}, V{i}[n, c, 2*p + r, 2*q + s] * U{i}[k, c, r, s])
D{i}[n, c, h, w] = S{i}[n, c*4 + h%2*2 + w%2, h//2, w//2]
B{i}[n, c, h, w] = D{i}[n, c, h, w] + Bias{i}[c]
R{i}[n, c, h, w] = max(B{i}[n, c, h, w], 0)
M{i}[n, c, p, q] = ReduceMax({{r: 2, s: 2}}, R{i}[n, c, 2*p + r, 2*q + s])
L{i}[n, c, h, w] = Select(h < 7 && w < 7, M{i}[n, c, h, w], 0) * 0.5
T{i}[n, c, h, w] = tanh(L{i}[n, c, h, w]) + L{i}[n, c, h, w]
X{next}[n, c, h, w] = Select(h < 8 && w < 8, T{i}[n, c, h, w], T{i}[n, c, h % 8, w % 8]) * 2
"""


def build_graph(blocks: int = 5) -> neoflow.Graph:
    """``blocks`` copies of a 10-op block chained together (50 ops for 5)."""
    text = "".join(BLOCK.format(i=i, next=i + 1) for i in range(blocks))
    shapes = {}
    for i in range(blocks):
        shapes.update(
            {
                f"W{i}": (16, 16, 3, 3),
                f"U{i}": (64, 16, 3, 3),
                f"Bias{i}": (16,),
                f"P{i}": (1, 16, 18, 18),
                f"L{i}": (1, 16, 16, 16),
                f"X{i + 1}": (1, 16, 16, 16),
            }
        )
    shapes["X0"] = (1, 16, 16, 16)
    return neoflow.graph(text, shapes=shapes)


def main() -> None:
    """Build the graph, derive every adjoint, print the time."""
    graph = build_graph()
    start = time.perf_counter()
    count = 0
    for op in graph.ops:
        count += len(grad(op))
    elapsed = time.perf_counter() - start
    print(f"machine: {platform.machine()}, python {platform.python_version()}")
    print(f"derived {count} adjoints of a {len(graph.ops)}-op graph in {elapsed:.2f} s")


if __name__ == "__main__":
    main()
