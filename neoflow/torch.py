"""neoflow ops as PyTorch operators (the optional extra ``neoflow[torch]``).

    import neoflow.torch
    caps = neoflow.torch.op("Out[b, k, p, q, i, j] = ReduceAdd({c, r, s, t}, "
                            "In[b, c, p*2 + r, q*2 + s, i, t] * W[k, c, r, s, t, j])")
    y = caps(x, w)            # torch tensors in, a torch tensor out
    y.sum().backward()        # x.grad, w.grad from the derived adjoints

Each expression becomes a real PyTorch operator (``torch.library.custom_op``, namespace ``neoflow``) with a
fake (meta) implementation and an autograd formula: it runs eagerly, inside ``torch.compile(fullgraph=True)``
without a graph break, under ``torch.autograd.gradcheck``, ``torch.no_grad`` and ``torch.export``.  Its
backward is a second operator running the op's derived gather-form adjoints, only those of the inputs that
need a gradient.  Inputs bind by position (in the order the expression first reads them) or by name; shapes
and dtype come from the tensors at call time, and the kernels are compiled once per shape, dtype and device
(and cached on disk as every neoflow kernel).  CPU tensors run on the ``cpu`` target, read and written without
copies (DLPack); CUDA tensors on the ``cuda`` target, read and written where they lie, the kernels queued on
the current stream.
``Module(expression, parameters={"W": shape})`` is an ``nn.Module`` holding the weights.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from neoflow.errors import InputError
from neoflow.ir import dtypes as dt
from neoflow.runtime.custom_op import CompiledOp
from neoflow.runtime.expression_op import ExpressionOp

__all__ = ["Module", "TorchOp", "op"]

#: the neoflow target a tensor's device runs on
TARGETS = {"cpu": "cpu", "cuda": "cuda"}


def op(expression: str, name: str | None = None, fusion: str = "neoflow", precision: str | None = None) -> TorchOp:
    """The tensor expression ``expression`` (one statement) as a PyTorch operator: call it with
    torch tensors (by position, in the order the expression first reads them, or by name).
    ``name`` names the operator (``torch.ops.neoflow.<name>``; default: from a hash of the text);
    ``precision``: how CUDA tensors' float32 contractions use the tensor cores (``tf32``, the
    default; ``fp32`` exact; ``fp16``, ``bf16``), as for ``neoflow.compile``."""
    with _REGISTRY_LOCK:
        key = name or _default_name(expression, precision)
        found = _REGISTRY.get(key)
        if found is None:
            found = _REGISTRY[key] = TorchOp(expression, key, fusion, precision)
        elif found.expression != expression or found.expression_op.precision != precision:
            raise InputError(
                f"an operator named '{key}' is already registered, for '{found.expression}' "
                f"(precision {found.expression_op.precision})"
            )
    return found


#: the operators registered in this process, by name (PyTorch registers a name once)
_REGISTRY: dict[str, TorchOp] = {}
_REGISTRY_LOCK = threading.Lock()


def _default_name(expression: str, precision: str | None = None) -> str:
    text = expression if precision is None else f"{expression}\n{precision}"
    return "op_" + hashlib.sha1(text.encode()).hexdigest()[:12]


class TorchOp:
    """A tensor expression registered as the PyTorch operator ``torch.ops.neoflow.<name>`` (forward)
    and ``torch.ops.neoflow.<name>_backward`` (the adjoints of the inputs asked for), with a fake
    implementation and an autograd formula.  ``inputs``: the input names in call order;
    ``output``: the output's name.  Made by ``op``, which registers each name once."""

    def __init__(
        self, expression: str, name: str | None = None, fusion: str = "neoflow", precision: str | None = None
    ) -> None:
        self.expression_op = ExpressionOp(expression, fusion, precision)
        self.expression = expression
        self.output, self.inputs = self.expression_op.output, self.expression_op.inputs
        self.name = name or _default_name(expression, precision)
        self.forward_op, self.backward_op = _register(self)

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        """The op's output: tensors by position (``inputs`` order) or by name."""
        tensors = self.expression_op.bind(args, kwargs)
        for input_name, tensor in zip(self.inputs, tensors, strict=True):
            if not isinstance(tensor, torch.Tensor):
                raise InputError(f"input '{input_name}' of {self.output} is a {type(tensor).__name__}, not a tensor")
        return self.forward_op(*tensors)

    def compiled(self, tensors: Sequence[torch.Tensor], grad: bool = False) -> CompiledOp:
        """The op compiled for these tensors' shapes, dtypes and device (``grad``: with its adjoints)."""
        shapes, dtypes = self._signature(tensors)
        return self.expression_op.compiled(shapes, dtypes, self._target(tensors), grad)

    def output_spec(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[int, ...], torch.dtype]:
        """The output's shape and dtype for these inputs (without compiling: what the fake runs)."""
        self._target(tensors)
        parsed = self.expression_op.parsed(*self._signature(tensors))
        return parsed.shape, _torch_dtype(parsed.dtype)

    def _signature(self, tensors: Sequence[torch.Tensor]) -> tuple[list[tuple[int, ...]], list[str]]:
        # int(): a traced symbolic size is specialised (kernels are compiled per shape)
        shapes = [tuple(int(d) for d in t.shape) for t in tensors]
        return shapes, [str(t.dtype).removeprefix("torch.") for t in tensors]

    def _target(self, tensors: Sequence[torch.Tensor]) -> str:
        """The target of the tensors' device (a fake's meta tensors: cpu, for shapes only)."""
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise InputError(f"{self.output}: inputs lie on different devices ({sorted(map(str, devices))})")
        device = devices.pop().type
        if device not in TARGETS and device != "meta":
            raise InputError(f"{self.output}: tensors on '{device}' are not supported (cpu or cuda)")
        return TARGETS.get(device, "cpu")

    def run_forward(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The forward operator's implementation: compile (once) and run."""
        compiled = self.compiled(tensors)
        if tensors[0].device.type == "cuda":
            shape, dtype = self.output_spec(tensors)
            result = torch.empty(shape, dtype=dtype, device=tensors[0].device)
            given = dict(zip(self.inputs, _device_arrays(tensors), strict=True))
            compiled.run(given, out=result, stream=torch.cuda.current_stream(result.device).cuda_stream)
            return result
        return torch.from_dlpack(compiled.run(_host_arrays(self.inputs, tensors)))

    def run_backward(self, grad: torch.Tensor, tensors: Sequence[torch.Tensor], wanted: Sequence[bool]) -> list:
        """The backward operator's implementation: the adjoints of the inputs ``wanted`` marks."""
        names = [n for n, w in zip(self.inputs, wanted, strict=True) if w]
        if not names:
            return []
        compiled = self.compiled(tensors, grad=True)
        missing = [n for n in names if n not in compiled.adjoints]
        if missing:
            raise InputError(f"{self.output}: input '{missing[0]}' has no gradient (not a float tensor)")
        output_grad = f"d{self.output}"
        if grad.device.type == "cuda":
            out = {
                n: torch.empty_like(t, memory_format=torch.contiguous_format)
                for n, t in zip(self.inputs, tensors, strict=True)
                if n in names
            }
            given = dict(zip(self.inputs, _device_arrays(tensors), strict=True))
            stream = torch.cuda.current_stream(grad.device).cuda_stream
            compiled.backward(given, {output_grad: grad.detach().contiguous()}, out=out, wrt=names, stream=stream)
            return [out[n] for n in names]
        arrays = _host_arrays([*self.inputs, output_grad], [*tensors, grad])
        results = compiled.backward(arrays, {output_grad: arrays.pop(output_grad)}, wrt=names)
        return [torch.from_dlpack(results[n]) for n in names]


def _device_arrays(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors as neoflow's executors read them in place: detached (autograd's flag hides the
    ``__cuda_array_interface__`` and DLPack) and contiguous (a strided view is copied)."""
    return [t.detach().contiguous() for t in tensors]


def _host_arrays(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> dict[str, np.ndarray]:
    """numpy views of CPU tensors by name (DLPack, no copy)."""
    return {n: np.from_dlpack(t) for n, t in zip(names, _device_arrays(tensors), strict=True)}


def _torch_dtype(dtype: str) -> torch.dtype:
    return getattr(torch, str(dt.numpy_dtype(dtype)) if dtype != "bfloat16" else "bfloat16")


def _register(layer: TorchOp) -> tuple[Callable, Callable]:
    """Register ``layer``'s forward and backward operators with PyTorch (fake implementations and the
    autograd formula included); returns the two operators."""
    qualname = f"neoflow::{layer.name}"
    arguments = ", ".join(f"Tensor {n}" for n in layer.inputs)
    forward = torch.library.custom_op(
        qualname, lambda *tensors: layer.run_forward(tensors), mutates_args=(), schema=f"({arguments}) -> Tensor"
    )
    backward = torch.library.custom_op(
        f"{qualname}_backward",
        lambda grad, *rest: layer.run_backward(grad, rest[:-1], rest[-1]),
        mutates_args=(),
        schema=f"(Tensor grad, {arguments}, bool[] wanted) -> Tensor[]",
    )

    @forward.register_fake
    def _(*tensors: torch.Tensor) -> torch.Tensor:
        shape, dtype = layer.output_spec(tensors)
        return tensors[0].new_empty(shape, dtype=dtype)

    @backward.register_fake
    def _(grad: torch.Tensor, *rest) -> list[torch.Tensor]:
        tensors, wanted = rest[:-1], rest[-1]
        return [
            torch.empty_like(t, memory_format=torch.contiguous_format)
            for t, w in zip(tensors, wanted, strict=True)
            if w
        ]

    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    def gradient(ctx, grad: torch.Tensor):
        tensors = ctx.saved_tensors
        wanted = [bool(w) and t.is_floating_point() for w, t in zip(ctx.needs_input_grad, tensors, strict=True)]
        results = iter(backward(grad, *tensors, wanted))
        return tuple(next(results) if w else None for w in wanted)

    forward.register_autograd(gradient, setup_context=setup_context)
    return forward, backward


class Module(torch.nn.Module):
    """An ``nn.Module`` computing ``expression`` with the inputs named in ``parameters`` held as
    ``nn.Parameter``s of the given shapes (initialised by ``init``, a function filling a tensor in
    place; default uniform in +-1/sqrt(fan-in), fan-in the product of all dims but the first).
    ``forward`` takes the other inputs, in the order the expression first reads them, or by name."""

    def __init__(
        self,
        expression: str,
        parameters: Mapping[str, Sequence[int]],
        init: Callable[[torch.Tensor], object] | None = None,
        dtype: torch.dtype = torch.float32,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.op = op(expression, name)
        unknown = sorted(set(parameters) - set(self.op.inputs))
        if unknown:
            raise InputError(
                f"parameter '{unknown[0]}' is not an input of {self.op.output} (inputs: {', '.join(self.op.inputs)})"
            )
        self.data_inputs = [n for n in self.op.inputs if n not in parameters]
        for key, shape in parameters.items():
            weight = torch.empty(tuple(shape), dtype=dtype)
            with torch.no_grad():
                if init is None:
                    bound = 1.0 / math.sqrt(max(1, math.prod(shape[1:])))
                    weight.uniform_(-bound, bound)
                else:
                    init(weight)
            self.register_parameter(key, torch.nn.Parameter(weight))

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        """The expression on the data inputs (by position or name) and the module's parameters."""
        if len(args) > len(self.data_inputs):
            expected = f"{len(self.data_inputs)} data tensors ({', '.join(self.data_inputs)})"
            raise InputError(f"{self.op.output} takes {expected}, got {len(args)}")
        given = {**dict(zip(self.data_inputs, args, strict=False)), **kwargs}
        given.update({n: p for n, p in self.named_parameters(recurse=False)})
        return self.op(**given)

    def extra_repr(self) -> str:
        return repr(self.op.expression)
