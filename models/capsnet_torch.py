"""A capsule network written in PyTorch whose capsule layers are neoflow operators — an example to copy.

    python models/capsnet_torch.py [--epochs 3] [--channels 16]

Two capsule convolutions (3x3 stride 1, then 3x3 stride 2; 1x2 poses, the second layer's weights 2x2
per pair of capsules) with a ReLU between them and a linear classifier, trained with Adam on
scikit-learn's 8x8 digits.  Each capsule layer is one line of tensor expression, a
``neoflow.torch.Module``: neoflow derives its backward and compiles both.  The same network written with
PyTorch alone (strided slices + einsum, ``CapsNet(reference=True)``) is what the script checks against:
the first 20 steps' losses must agree to 1e-4; then it trains, and times a training step of each
(blocks of steps taking turns) and prints the ratio.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import neoflow.torch as nt

CAPSULE = (
    "Out[b, k, p, q, i, j] = ReduceAdd({{c, r, s, t}}, "
    "In[b, c, p*{stride} + r, q*{stride} + s, i, t] * W[k, c, r, s, t, j])"
)


class EinsumCapsuleConv(nn.Module):
    """The capsule convolution in plain PyTorch: the 3x3 window's strided slices stacked, then einsum."""

    def __init__(self, weight_shape: tuple[int, ...], stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.W = nn.Parameter(torch.empty(weight_shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size, step = (x.shape[2] - 3) // self.stride + 1, self.stride
        rows = [
            torch.stack([x[:, :, r : r + step * size : step, s : s + step * size : step] for s in range(3)], 0)
            for r in range(3)
        ]
        return torch.einsum("rsbcpqit,kcrstj->bkpqij", torch.stack(rows, 0), self.W)


class CapsNet(nn.Module):
    """Digits (1x8x8) -> capsule conv (stride 1, poses 1x2) -> ReLU -> capsule conv (stride 2, 2x2 weights)
    -> flatten -> linear over 10 classes.  ``reference``: the capsule layers in plain PyTorch."""

    def __init__(self, channels: int = 16, reference: bool = False) -> None:
        super().__init__()
        shapes = {1: (channels, 1, 3, 3, 1, 2), 2: (channels, channels, 3, 3, 2, 2)}
        if reference:
            self.caps1, self.caps2 = (EinsumCapsuleConv(shapes[s], s) for s in (1, 2))
        else:
            self.caps1, self.caps2 = (nt.Module(CAPSULE.format(stride=s), {"W": shapes[s]}) for s in (1, 2))
        self.head = nn.Linear(channels * 2 * 2 * 1 * 2, 10)  # k, p, q, i, j

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        capsules = x.reshape(x.shape[0], 1, 8, 8, 1, 1)
        hidden = F.relu(self.caps1(capsules))
        return self.head(self.caps2(hidden).flatten(1))


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as (1797, 64) floats in [0, 1] and their labels, shuffled with a fixed seed."""
    from sklearn.datasets import load_digits

    data = load_digits()
    order = torch.randperm(len(data.target), generator=torch.Generator().manual_seed(0))
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)[order]
    return x, torch.tensor(data.target)[order]


def trainer(model: nn.Module, lr: float = 1e-2):
    """A function running one Adam step of ``model`` on a batch, returning the loss."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def twins(channels: int) -> tuple[CapsNet, CapsNet]:
    """The neoflow network and the plain-PyTorch one, with the same initial weights."""
    torch.manual_seed(0)
    ours = CapsNet(channels)
    theirs = CapsNet(channels, reference=True)
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))
    return ours, theirs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    x, y = digits()
    batches = [(x[k : k + args.batch], y[k : k + args.batch]) for k in range(0, len(y) - args.batch + 1, args.batch)]
    ours, theirs = twins(args.channels)
    ours_step, theirs_step = trainer(ours), trainer(theirs)
    worst = 0.0
    for k in range(min(20, len(batches))):
        a, b = ours_step(*batches[k]), theirs_step(*batches[k])
        worst = max(worst, abs(a - b))
    print(f"first {min(20, len(batches))} steps: largest loss difference to the plain-PyTorch network {worst:.1e}")
    if worst > 1e-4:
        print("MISMATCH: the losses differ by more than 1e-4")
        return 1
    for epoch in range(args.epochs):
        losses = [ours_step(*batch) for batch in batches]
        with torch.no_grad():
            accuracy = (ours(x).argmax(1) == y).float().mean().item()
        print(f"epoch {epoch + 1}: mean loss {statistics.mean(losses):.4f}, accuracy {accuracy:.1%}")
    times: dict[str, list[float]] = {"neoflow": [], "PyTorch (einsum)": []}
    steps = {"neoflow": ours_step, "PyTorch (einsum)": theirs_step}
    for _ in range(5):  # rounds: each takes a block of 10 steps in turn
        for name, step in steps.items():
            for batch in batches[:10]:
                start = time.perf_counter()
                step(*batch)
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"training step (batch {args.batch}, {args.threads} threads): neoflow {medians['neoflow'] * 1e3:.2f} ms, "
        f"PyTorch (einsum) {medians['PyTorch (einsum)'] * 1e3:.2f} ms: "
        f"{medians['PyTorch (einsum)'] / medians['neoflow']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
