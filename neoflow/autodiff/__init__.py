"""Expression-based autodiff: adjoints derived by inverting index maps.

``grad(op)`` gives, for each input of ``op``, an ordinary op computing that
input's adjoint from the output adjoint ``d<Out>`` (and forward tensors where
the derivative needs them) — in gather form, with an exact iteration domain.
"""

from __future__ import annotations

from collections.abc import Sequence

from neoflow.autodiff.adjoint import AdjointInfo, adjoint
from neoflow.errors import NonInvertibleMapError
from neoflow.ir.op import Op

__all__ = ["AdjointInfo", "adjoint", "grad"]


def grad(op: Op, wrt: Sequence[str] | str | None = None) -> dict[str, Op]:
    """Adjoint ops of ``op`` by input name (all float inputs, or those in ``wrt``).

    Each adjoint ``d<A>`` reads ``d<op.name>`` (the output adjoint) and whichever
    forward tensors its derivative needs; ``adjoint_op.info`` is an
    ``AdjointInfo`` (gather/scatter, new reduction axes, waste).  Raises
    ``NonInvertibleMapError`` naming the op and the read it cannot handle."""
    names = (
        [wrt]
        if isinstance(wrt, str)
        else list(wrt)
        if wrt is not None
        else [t.name for t in op.inputs if t.dtype.startswith("float")]
    )
    for name in names:
        if name not in op.input_names:
            raise NonInvertibleMapError(
                f"'{name}' is not an input of the op (inputs: {', '.join(op.input_names)})", op=op.name
            )
    return {name: adjoint(op, name) for name in names}
