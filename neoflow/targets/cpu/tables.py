"""Index tables a kernel builds on its first call and keeps.

The blocked kernels look their rows', columns' and depth's index variables and
read offsets up in tables (``gemm``, ``packing``, ``depth_vector``).  The tables
depend on the op's shapes only, so they are built once: declared ``static`` in
the kernel's block and filled by the first call, under a lock so that two
threads calling the kernel at once (ctypes lets go of the GIL) neither build
them twice nor read them half built.  Rebuilding them on every call took a
single thread tens of microseconds per kernel (about a tenth of the four-op
convolution) while the other threads waited.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass

from neoflow.codegen.c_expr import unflatten_index


@dataclass(frozen=True)
class Table:
    """C declaring a table's pointers (``static``) and C allocating and filling them."""

    declare: str
    build: str


def built_once(tables: Iterable[Table]) -> str:
    """C declaring ``tables`` and building them, in order, on the kernel's first call only."""
    tables = list(tables)
    declarations = "\n        ".join(table.declare for table in tables)
    builds = textwrap.indent("\n".join(table.build for table in tables), " " * 16)
    return f"""{declarations}
        static int tables_built_;
        static char tables_lock_;
        if (!__atomic_load_n(&tables_built_, __ATOMIC_ACQUIRE)) {{
            while (__atomic_test_and_set(&tables_lock_, __ATOMIC_ACQUIRE)) {{
            }}
            if (!__atomic_load_n(&tables_built_, __ATOMIC_RELAXED)) {{
{builds}
                __atomic_store_n(&tables_built_, 1, __ATOMIC_RELEASE);
            }}
            __atomic_clear(&tables_lock_, __ATOMIC_RELEASE);
        }}"""


def index_table(name: str, variables: list[tuple[str, int]], offset: str | None) -> Table:
    """``<name>_tab``: the value of each variable at every flat index of the group
    (row-major, interleaved) and, given an offset expression (C over ``v_<variable>``),
    ``<name>_off``: the offset at each flat index."""
    size = math.prod(e for _, e in variables)
    width = len(variables)
    stores = " ".join(f"{name}_tab[f * {width} + {d}] = (int32_t)v_{v};" for d, (v, _) in enumerate(variables))
    declare = f"static int32_t *{name}_tab;"
    lines = [f"{name}_tab = (int32_t *)malloc(sizeof(int32_t) * {max(size * width, 1)});"]
    if offset is not None:
        declare += f" static int64_t *{name}_off;"
        lines.append(f"{name}_off = (int64_t *)malloc(sizeof(int64_t) * {max(size, 1)});")
        stores += f" {name}_off[f] = {offset};"
    lines.append(f"for (int64_t f = 0; f < {size}; ++f) {{ {unflatten_index('f', variables)} {stores} }}")
    return Table(declare, "\n".join(lines))
