"""PyTorch twins of the example models in models/, for parity tests."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

Params = Mapping[str, torch.Tensor]


def mlp(p: Params) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: F.relu(x @ p["w1"].T + p["b1"]) @ p["w2"].T + p["b2"]


def cnn(p: Params) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(F.conv2d(x, p["c1"], p["cb1"], padding=1)), 2)
        h = F.max_pool2d(F.relu(F.conv2d(h, p["c2"], p["cb2"], padding=1)), 2)
        return h.flatten(1) @ p["w"].T + p["b"]

    return forward


def capsule_conv(x: torch.Tensor, k: torch.Tensor, stride: int) -> torch.Tensor:
    """``Out[b,k,p,q,i,j] = sum_{c,r,s,t} x[b,c,p*stride+r,q*stride+s,i,t] * k[k,c,r,s,t,j]`` with unfold + einsum."""
    b, c, height, width, poses_i, poses_t = x.shape
    _, _, kr, ks, _, _ = k.shape
    p_out, q_out = (height - kr) // stride + 1, (width - ks) // stride + 1
    planes = x.permute(0, 1, 4, 5, 2, 3).reshape(b, c * poses_i * poses_t, height, width)
    cols = F.unfold(planes, (kr, ks), stride=stride).reshape(b, c, poses_i, poses_t, kr, ks, p_out, q_out)
    return torch.einsum("bcitrspq,kcrstj->bkpqij", cols, k)


def capsule(p: Params) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        h = F.relu(capsule_conv(x.reshape(x.shape[0], 1, 8, 8, 1, 1), p["k1"], 1))
        h = capsule_conv(h, p["k2"], 2)
        return h.flatten(1) @ p["w"].T + p["b"]

    return forward


def four_op(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The seed's four-op graph: B = A padded by 2 with its first row/column dropped
    (the Select keeps 2 < h < 226), D = dilated conv stride 2, E = pixel shuffle, F = cat(A, E)."""
    size = a.shape[-1]
    keep = torch.zeros(size + 4, size + 4)
    keep[3 : size + 2, 3 : size + 2] = 1
    b = F.pad(a, (2, 2, 2, 2)) * keep
    d = F.conv2d(b, c, stride=2, dilation=2)
    return torch.cat([a, F.pixel_shuffle(d, 2)], 1)


MODELS = {"mlp": mlp, "cnn": cnn, "capsule": capsule}


def assert_trains_like(
    model,
    reference: Callable[[torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    batches,
    labels: str = "y",
    rel: float = 1e-5,
    abs: float = 1e-6,
) -> None:
    """Each of ``batches`` (x, y tensors) one cross-entropy step of PyTorch's ``reference`` with
    ``optimizer`` and one ``model.train_step`` (x as float32, labels named ``labels``): the losses agree.
    ``reference`` sees x in its own parameters' dtype (a float64 reference holds the exact losses)."""
    import pytest

    for x, y in batches:
        optimizer.zero_grad()
        dtype = next(iter(optimizer.param_groups[0]["params"])).dtype
        loss = F.cross_entropy(reference(x.to(dtype)), y)
        loss.backward()
        optimizer.step()
        ours = model.train_step({"x": x.float().numpy(), labels: y.numpy()})
        assert ours == pytest.approx(loss.item(), rel=rel, abs=abs)
