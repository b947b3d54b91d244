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
need a gradient.  A plain eager call runs the same implementation and formula through a
``torch.autograd.Function``, without the operator's Python dispatch (``_plain_eager``).  Inputs bind by
position (in the order the expression first reads them) or by name; shapes and dtype come from the tensors
at call time, and the kernels are compiled once per shape, dtype and device (and cached on disk as every
neoflow kernel).  CPU tensors run on the ``cpu`` target, read and written without copies (the kernels get
the tensors' addresses); CUDA tensors on the ``cuda`` target, read and written where they lie, the kernels
queued on the current stream.
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
        self._by_signature: dict[tuple, CompiledOp] = {}
        self._host_calls: dict[tuple, _HostCall | None] = {}
        self.forward_op, self.backward_op = _register(self)

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        """The op's output: tensors by position (``inputs`` order) or by name."""
        tensors = self.expression_op.bind(args, kwargs)
        for input_name, tensor in zip(self.inputs, tensors, strict=True):
            if not isinstance(tensor, torch.Tensor):
                raise InputError(f"input '{input_name}' of {self.output} is a {type(tensor).__name__}, not a tensor")
        if _plain_eager(tensors):
            return _EagerCall.apply(self, *tensors)
        return self.forward_op(*tensors)

    def compiled(self, tensors: Sequence[torch.Tensor], grad: bool = False) -> CompiledOp:
        """The op compiled for these tensors' shapes, dtypes and device (``grad``: with its adjoints).
        Real tensors only (a traced call's fakes go to ``output_spec``): their sizes are ints, so the
        tensors' own sizes, dtypes and devices key a lookup that skips the signature's checks."""
        key = (grad, *((t.shape, t.dtype, t.device) for t in tensors))
        found = self._by_signature.get(key)
        if found is None:
            shapes, dtypes = self._signature(tensors)
            found = self._by_signature[key] = self.expression_op.compiled(shapes, dtypes, self._target(tensors), grad)
        return found

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
        call = self._host_call(compiled, None, self.inputs, tensors)
        if call is not None:
            return call(tensors)[0]
        return torch.from_numpy(compiled.run(_host_arrays(self.inputs, tensors)))

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
        given = [*tensors, grad]
        call = self._host_call(compiled, frozenset(names), [*self.inputs, output_grad], given)
        if call is not None:
            computed = dict(zip(call.output_names, call(given), strict=True))
            return [computed[compiled.adjoints[n].name] for n in names]
        arrays = _host_arrays([*self.inputs, output_grad], given)
        results = compiled.backward(arrays, {output_grad: arrays.pop(output_grad)}, wrt=names)
        return [torch.from_numpy(results[n]) for n in names]

    def _host_call(
        self, compiled: CompiledOp, wrt: frozenset[str] | None, names: Sequence[str], tensors: Sequence[torch.Tensor]
    ) -> _HostCall | None:
        """The forward (``wrt`` None) or the adjoints of ``wrt`` of ``compiled`` run on the CPU tensors'
        own memory, made on first use and kept; None where the executor cannot (an op without a C kernel,
        a dtype numpy lacks), and the arrays' path runs it."""
        key = (compiled, wrt)
        if key not in self._host_calls:
            executor = compiled.forward_executor if wrt is None else compiled.adjoint_executor(wrt)[1]
            self._host_calls[key] = _HostCall.of(executor, names, tensors)
        return self._host_calls[key]


def _device_arrays(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors as neoflow's executors read them in place: detached (autograd's flag hides the
    ``__cuda_array_interface__`` and DLPack) and contiguous (a strided view is copied)."""
    return [t.detach().contiguous() for t in tensors]


def _host_arrays(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> dict[str, np.ndarray]:
    """numpy views of CPU tensors by name (no copy: ``Tensor.numpy`` shares the memory, as DLPack
    does, in a fifth of the time of torch's Python ``__dlpack__``)."""
    return {n: t.numpy() for n, t in zip(names, _device_arrays(tensors), strict=True)}


class _HostCall:
    """A CPU executor run on torch tensors' memory (``CpuExecutor.run_at``): the call's tensors (by
    position in ``names``) picked in the executor's input order, its outputs fresh torch tensors
    (``output_names``) — no numpy array made, nothing checked per call beyond what the signature fixed."""

    def __init__(self, executor: object, picks: list[int], outputs: list[tuple[str, tuple, torch.dtype]]) -> None:
        self._run_at = executor.run_at
        self._picks = picks
        self._outputs = [(shape, dtype) for _, shape, dtype in outputs]
        self.output_names = [name for name, _, _ in outputs]

    @classmethod
    def of(cls, executor: object, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> _HostCall | None:
        """The call for ``executor`` given ``tensors`` named ``names``; None where the executor has no
        ``run_at``, leaves a kept tensor uncomputed, or a tensor's dtype is not its input's."""
        if not getattr(executor, "addressable", False) or len(executor.output_specs) != len(executor.keep):
            return None
        position = {n: k for k, n in enumerate(names)}
        picks = [position[n] for n in executor.input_names]
        wanted = {t.name: t.dtype for t in executor.graph.inputs}
        if any(_torch_dtype(wanted[names[k]]) != tensors[k].dtype for k in picks):
            return None
        outputs = [(name, shape, _torch_dtype(str(dtype))) for name, shape, dtype in executor.output_specs]
        return cls(executor, picks, outputs)

    def __call__(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The outputs (``output_names`` order) of one run on ``tensors`` (the call's, all positions)."""
        held = _device_arrays([tensors[k] for k in self._picks])  # alive until the run returns
        outputs = [torch.empty(shape, dtype=dtype) for shape, dtype in self._outputs]
        self._run_at([t.data_ptr() for t in held], [t.data_ptr() for t in outputs])
        return outputs


def _plain_eager(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a call may take the eager path (``_EagerCall``): plain tensors, nothing tracing them —
    not dynamo (``torch.compile``, ``torch.export``), no fake or functional tensors or other
    subclasses, no dispatch or function mode, no functorch transform.  Anything else goes through
    the registered operator, whose Python dispatch costs some 30 microseconds a call."""
    return (
        not torch.compiler.is_compiling()
        and all(type(t) in _PLAIN_TENSORS for t in tensors)
        and not torch._C._len_torch_dispatch_stack()
        and not torch._C._is_torch_function_mode_enabled()
        and not torch._C._are_functorch_transforms_active()
    )


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


class _EagerCall(torch.autograd.Function):
    """An eager call of a ``TorchOp``: the operator's implementation and autograd formula, run by
    autograd directly (the same compiled kernels, the registered operator's dispatch skipped)."""

    @staticmethod
    def forward(ctx, layer: TorchOp, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.layer = layer
        ctx.save_for_backward(*tensors)
        return layer.run_forward(tensors)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        tensors = ctx.saved_tensors
        wanted = _wanted(ctx.needs_input_grad[1:], tensors)
        results = iter(ctx.layer.run_backward(grad, tensors, wanted))
        return (None, *(next(results) if w else None for w in wanted))


def _wanted(needs_grad: Sequence[bool], tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Per input, whether its gradient is computed: asked for, and the input a float tensor."""
    return [bool(w) and t.is_floating_point() for w, t in zip(needs_grad, tensors, strict=True)]


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
        wanted = _wanted(ctx.needs_input_grad, tensors)
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
        given.update(self._parameters)  # this module's own (named_parameters builds a generator: microseconds a call)
        return self.op(**given)

    def extra_repr(self) -> str:
        return repr(self.op.expression)
