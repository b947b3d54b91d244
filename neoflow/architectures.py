"""Real CNN and transformer architectures, written in PyTorch the way their papers draw them, sized
for 3x32x32 (CIFAR) images, and their ONNX export the way users make it.

    resnet18      — CIFAR ResNet-18: BasicBlocks [2, 2, 2, 2], BatchNorm, residual adds, 1x1 projections
    mobilenet_v2  — inverted residuals: 1x1 expand, 3x3 depthwise, 1x1 project, ReLU6, BatchNorm
    shufflenet_v2 — ShuffleNetV2 units: channel split, depthwise 3x3, 1x1 convs, concat, channel shuffle
    vit           — a small ViT: 4x4 patches, pre-LN blocks of multi-head attention (softmax) and a GELU MLP

``width`` scales the channels (tests use small widths; the benchmark the published ones).  The
CPU benchmark (``benchmarks/models.py``), the PyTorch-export tests and the fusion corpus
(``neoflow.corpus``, ``neoflow fuse --corpus``) share them.  Importing this module needs PyTorch.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]


class BasicBlock(nn.Module):
    """ResNet's two 3x3 convolutions with a residual add (a 1x1 projection where the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*_conv_bn(cin, cout, 3, stride), nn.ReLU(), *_conv_bn(cout, cout, 3))
        self.shortcut = nn.Sequential(*_conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


class ResNet18(nn.Module):
    """CIFAR ResNet-18 (He et al.): a 3x3 stem, four stages of two BasicBlocks, global average pool."""

    def __init__(self, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [*_conv_bn(3, width, 3), nn.ReLU()]
        cin = width
        for stage, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
            for block in range(2):
                layers.append(BasicBlock(cin, cout, 2 if stage and not block else 1))
                cin = cout
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expansion, 3x3 depthwise, linear 1x1 projection; residual at stride 1."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        self.residual = stride == 1 and cin == cout
        self.body = nn.Sequential(
            *_conv_bn(cin, hidden, 1),
            nn.ReLU6(),
            *_conv_bn(hidden, hidden, 3, stride, groups=hidden),
            nn.ReLU6(),
            *_conv_bn(hidden, cout, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) if self.residual else self.body(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 (Sandler et al.) for 32x32 inputs: (expansion, channels, blocks, stride) stages."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        stages = ((1, width, 1, 1), (6, width * 3 // 2, 2, 1), (6, 2 * width, 2, 2), (6, 4 * width, 2, 2))
        layers: list[nn.Module] = [*_conv_bn(3, 2 * width, 3), nn.ReLU6()]
        cin = 2 * width
        for expand, cout, blocks, stride in stages:
            for block in range(blocks):
                layers.append(InvertedResidual(cin, cout, stride if block == 0 else 1, expand))
                cin = cout
        layers += [*_conv_bn(cin, 8 * width, 1), nn.ReLU6()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(8 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    """ShuffleNet's channel shuffle: (N, g*c, H, W) -> view (N, g, c, H, W) -> transpose -> flatten."""
    n, channels, h, w = x.shape
    return x.view(n, groups, channels // groups, h, w).transpose(1, 2).reshape(n, channels, h, w)


class ShuffleUnit(nn.Module):
    """ShuffleNetV2's unit: at stride 1 half the channels pass through, the other half is 1x1 ->
    depthwise 3x3 -> 1x1; at stride 2 both halves are transformed; concat, then channel shuffle."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        branch = cout // 2
        into = cin if stride == 2 else cin // 2
        self.main = nn.Sequential(
            *_conv_bn(into, branch, 1),
            nn.ReLU(),
            *_conv_bn(branch, branch, 3, stride, groups=branch),
            *_conv_bn(branch, branch, 1),
            nn.ReLU(),
        )
        if stride == 2:
            self.side = nn.Sequential(*_conv_bn(cin, cin, 3, stride, groups=cin), *_conv_bn(cin, branch, 1), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1:
            kept, moved = x.chunk(2, dim=1)
            out = torch.cat((kept, self.main(moved)), 1)
        else:
            out = torch.cat((self.side(x), self.main(x)), 1)
        return channel_shuffle(out, 2)


class ShuffleNetV2(nn.Module):
    """ShuffleNetV2 (Ma et al.) for 32x32 inputs: a stem, three stages (first unit strided), a 1x1 head
    convolution; the grouped 1x1 convolutions of the ``groups`` variant stand in the first stage."""

    def __init__(self, width: int = 24, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [*_conv_bn(3, width, 3), nn.ReLU()]
        cin = width
        for cout, units in ((4 * width, 3), (8 * width, 3), (16 * width, 2)):
            for unit in range(units):
                layers.append(ShuffleUnit(cin, cout, 2 if unit == 0 else 1))
                cin = cout
        layers += [nn.Conv2d(cin, cin, 1, groups=4, bias=False), nn.BatchNorm2d(cin), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


class Attention(nn.Module):
    """Multi-head self-attention through one ``qkv`` projection, softmax(QK^T / sqrt(d)) V."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, tokens, dim = x.shape
        q, k, v = self.qkv(x).reshape(n, tokens, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (dim // self.heads) ** -0.5
        mixed = scores.softmax(-1) @ v
        return self.out(mixed.transpose(1, 2).reshape(n, tokens, dim))


class Block(nn.Module):
    """A pre-LN transformer block: x + attention(LN(x)), then x + MLP(LN(x)) with GELU."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """A small vision transformer (Dosovitskiy et al.): 4x4 patches of a 32x32 image (64 tokens), a learned
    position embedding, ``depth`` pre-LN blocks, a final LayerNorm, mean-pooled tokens, a linear head."""

    def __init__(self, width: int = 64, depth: int = 4, heads: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, width, 4, 4)
        self.position = nn.Parameter(torch.randn(1, 64, width) * 0.02)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patches(x).flatten(2).transpose(1, 2) + self.position
        return self.head(self.norm(self.blocks(tokens)).mean(1))


ARCHITECTURES: dict[str, Callable[..., nn.Module]] = {
    "resnet18": ResNet18,
    "mobilenet_v2": MobileNetV2,
    "shufflenet_v2": ShuffleNetV2,
    "vit": ViT,
}


def build(name: str, width: int | None = None, seed: int = 0) -> nn.Module:
    """The architecture ``name`` with seeded weights (``width`` None: the benchmark's size)."""
    torch.manual_seed(seed)
    return ARCHITECTURES[name]() if width is None else ARCHITECTURES[name](width=width)


def export(model: nn.Module, batch: int, train: bool) -> bytes:
    """``model`` as ONNX bytes, exported the way users do: TorchScript exporter, opset 17, an input
    ``x`` of ``batch`` 3x32x32 images and an output ``y``; ``train``: training mode
    (``TrainingMode.TRAINING``, no constant folding: BatchNorm stays a training-mode node), else eval."""
    buffer = io.BytesIO()
    mode = torch.onnx.TrainingMode.TRAINING if train else torch.onnx.TrainingMode.EVAL
    model.train(train)
    torch.onnx.export(
        model,
        (torch.zeros(batch, 3, 32, 32),),
        buffer,
        input_names=["x"],
        output_names=["y"],
        opset_version=17,
        dynamo=False,
        training=mode,
        do_constant_folding=not train,
    )
    return buffer.getvalue()
