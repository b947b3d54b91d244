"""neoflow.torch: a tensor expression as a PyTorch operator (eager, autograd, torch.compile, export)."""

from __future__ import annotations

import pytest
import torch

import neoflow
import neoflow.torch as nt

CAPSULE = "Out[b, k, p, q, i, j] = ReduceAdd({c, r, s, t}, In[b, c, p*2 + r, q*2 + s, i, t] * W[k, c, r, s, t, j])"


def capsule_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The stride-2 capsule convolution with unfold-style slicing and einsum."""
    size = (x.shape[2] - 3) // 2 + 1
    cols = torch.stack(
        [torch.stack([x[:, :, r : r + 2 * size : 2, s : s + 2 * size : 2] for s in range(3)], 0) for r in range(3)], 0
    )
    return torch.einsum("rsbcpqit,kcrstj->bkpqij", cols, w)


def _tensors(dtype=torch.float32, grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 9, 9, 2, 2, generator=generator, dtype=dtype)
    w = torch.randn(4, 3, 3, 3, 2, 2, generator=generator, dtype=dtype)
    return x.requires_grad_(grad), w.requires_grad_(grad)


def test_eager_forward_and_backward_match_pytorch() -> None:
    caps = nt.op(CAPSULE)
    assert caps.inputs == ["In", "W"] and caps is nt.op(CAPSULE)  # registered once
    x, w = _tensors()
    y = caps(x, w)
    want = capsule_reference(x, w)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    dout = torch.randn_like(y)
    y.backward(dout)
    got = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    want.backward(dout)
    torch.testing.assert_close(got[0], x.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], w.grad, rtol=1e-4, atol=1e-4)


def test_gradcheck_in_float64_and_the_operator_registration() -> None:
    caps = nt.op(CAPSULE)
    x, w = _tensors(torch.float64)
    assert torch.autograd.gradcheck(caps, (x, w))
    checks = torch.library.opcheck(caps.forward_op, (x.detach(), w.detach()))
    assert set(checks.values()) == {"SUCCESS"}


def test_inside_torch_compile_without_a_graph_break() -> None:
    caps = nt.op(CAPSULE)
    x, w = _tensors()
    loss = torch.compile(lambda a, b: caps(a, b).relu().square().sum(), fullgraph=True)(x, w)
    loss.backward()
    got = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    want = capsule_reference(x, w).relu().square().sum()
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[0], x.grad, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(got[1], w.grad, rtol=1e-4, atol=1e-3)


def test_export_keeps_the_operator() -> None:
    caps = nt.op(CAPSULE)
    x, w = _tensors(grad=False)

    class Net(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return caps(a, b) * 2

    exported = torch.export.export(Net(), (x, w))
    assert f"torch.ops.neoflow.{caps.name}" in exported.graph_module.code
    torch.testing.assert_close(exported.module()(x, w), 2 * capsule_reference(x, w), rtol=1e-5, atol=1e-5)


def test_no_grad_non_contiguous_inputs_and_names() -> None:
    caps = nt.op(CAPSULE)
    x, w = _tensors()
    with torch.no_grad():
        y = caps(x, w)
    assert not y.requires_grad
    transposed = x.detach().transpose(2, 3)  # a strided view
    assert not transposed.is_contiguous()
    torch.testing.assert_close(caps(W=w.detach(), In=transposed), capsule_reference(transposed, w.detach()))


def test_backward_computes_only_the_gradients_asked_for() -> None:
    caps = nt.op("Y[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", name="matmul_only_asked")
    a = torch.randn(5, 4)
    b = torch.randn(4, 3, requires_grad=True)
    caps(a, b).sum().backward()
    torch.testing.assert_close(b.grad, a.sum(0)[:, None].expand(4, 3))
    (key,) = [key for key in caps.expression_op.compiled_keys() if key[-1]]
    compiled = caps.expression_op.compiled(*key)
    assert set(compiled._partial) == {frozenset({"B"})}  # dA was neither compiled nor run


def test_integer_inputs_keep_their_dtype() -> None:
    gather = nt.op("Y[i, j] = X[Idx[i], j]", name="gather_rows")
    x = torch.randn(6, 3, requires_grad=True)
    index = torch.tensor([4, 0, 4, 2])
    y = gather(x, index)
    torch.testing.assert_close(y, x[index])
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.zeros(6, 3).index_add_(0, index, torch.ones(4, 3)))


def test_bad_calls_are_neoflow_errors() -> None:
    caps = nt.op(CAPSULE)
    x, w = _tensors(grad=False)
    with pytest.raises(neoflow.InputError, match="takes 2 tensors"):
        caps(x, w, w)
    with pytest.raises(neoflow.InputError, match="'V' is not an input"):
        caps(x, V=w)
    with pytest.raises(neoflow.InputError, match="missing input 'W'"):
        caps(x)
    with pytest.raises(neoflow.InputError, match="mix dtypes"):
        caps(x, w.double())
    with pytest.raises(neoflow.InputError, match="already registered"):
        nt.op("Y[i] = X[i] * 2", name=caps.name)
    with pytest.raises(neoflow.ParseError):
        nt.op("Y[i] = X[i] +")


def test_module_holds_the_weights_and_trains() -> None:
    torch.manual_seed(0)
    layer = nt.Module(CAPSULE, parameters={"W": (4, 3, 3, 3, 2, 2)})
    assert [name for name, _ in layer.named_parameters()] == ["W"] and layer.data_inputs == ["In"]
    x = torch.randn(2, 3, 9, 9, 2, 2)
    target = torch.randn(2, 4, 4, 4, 2, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.01)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = (layer(x) - target).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    torch.testing.assert_close(layer(In=x), capsule_reference(x, layer.W))


def test_the_capsnet_example_trains_like_its_plain_pytorch_twin() -> None:
    """models/capsnet_torch.py: its neoflow capsule layers give the losses of the einsum network."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "models" / "capsnet_torch.py"
    spec = importlib.util.spec_from_file_location("capsnet_torch", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    ours, theirs = example.twins(channels=4)
    ours_step, theirs_step = example.trainer(ours), example.trainer(theirs)
    x, y = example.digits()
    for k in range(5):
        batch = x[16 * k : 16 * k + 16], y[16 * k : 16 * k + 16]
        assert ours_step(*batch) == pytest.approx(theirs_step(*batch), abs=1e-5)


def test_eager_calls_run_the_kernels_directly_and_traced_ones_the_operator() -> None:
    """An eager call skips the registered operator's Python dispatch (autograd runs its formula
    directly); under a dispatch mode (as tracing and fake tensors are) the operator runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    caps = nt.op(CAPSULE)
    x, w = _tensors()
    eager = caps(x, w)
    assert type(eager.grad_fn).__name__ == "_EagerCallBackward"
    with Seen() as seen:
        traced = caps(x, w)
    assert f"neoflow.{caps.name}.default" in seen.ops
    torch.testing.assert_close(traced, eager)
    eager.sum().backward()
    got = w.grad.clone()
    w.grad = None
    traced.sum().backward()
    torch.testing.assert_close(got, w.grad)


def test_a_backward_does_not_recompute_the_forward_unless_an_adjoint_reads_it() -> None:
    caps = nt.op(CAPSULE)
    x, w = _tensors()
    compiled = caps.compiled([x, w], grad=True)
    assert caps.output not in {op.name for op in compiled.backward_graph.ops}
    exp = nt.op("Y[i] = exp(X[i])", name="exp_reads_its_output")
    compiled = exp.compiled([torch.randn(5)], grad=True)
    assert "Y" in {op.name for op in compiled.backward_graph.ops}
    v = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(exp, (v,))
