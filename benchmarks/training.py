"""Training steps of the example models: memory plan and step time, neoflow vs PyTorch eager.

    python -m benchmarks.training

For each model in models/ this compiles a training step and prints, as a
markdown table, the peak live memory of the step against the naive total
(every tensor its own buffer), and the median time of a training step over
10 runs after warm-up for neoflow (target interp, the reference interpreter)
and, where an equivalent exists, PyTorch eager (same weights, same batch).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import neoflow
from benchmarks.timing import interleaved_medians
from neoflow.targets.memory import MemoryPlan
from tests.runtime.torch_models import MODELS

MODELS_DIR = Path(__file__).resolve().parents[1] / "models"
CASES = [
    ("mlp.onnx", neoflow.TrainSpec(labels="y", optimizer="sgd", lr=0.05)),
    ("cnn.onnx", neoflow.TrainSpec(labels="y", optimizer="adam", lr=1e-2)),
    ("capsule.onnx", neoflow.TrainSpec(labels="y", optimizer="adam", lr=1e-2)),
    ("upsampler.onnx", neoflow.TrainSpec(loss="mse", labels="target", optimizer="adam")),
    ("four_op.onnx", neoflow.TrainSpec(loss="mse", labels="target", optimizer="sgd")),
]
RUNS = 10


def _size(count: int) -> str:
    return f"{count / 1024:.1f} KiB" if count < 1 << 20 else f"{count / (1 << 20):.1f} MiB"


def _batch(model: neoflow.CompiledModel, rng: np.random.Generator) -> dict[str, np.ndarray]:
    training = model.training
    batch = {model.public_name(t.name): rng.standard_normal(t.shape).astype(np.float32) for t in training.data_inputs}
    labels = training.labels
    if labels.dtype == "int64":
        batch[model.spec.labels] = rng.integers(0, 10, labels.shape)
    else:
        batch[model.spec.labels] = rng.standard_normal(labels.shape).astype(np.float32)
    return batch


def _torch_step(name: str, model: neoflow.CompiledModel, batch: dict[str, np.ndarray]):
    kind = name.removesuffix(".onnx")
    if kind not in MODELS:
        return None
    params = {k: torch.tensor(v, requires_grad=True) for k, v in model.parameters().items()}
    forward = MODELS[kind](params)
    spec = model.spec
    optim = (torch.optim.Adam if spec.optimizer == "adam" else torch.optim.SGD)(params.values(), lr=spec.lr)
    x, y = torch.from_numpy(batch["x"]), torch.from_numpy(batch["y"])

    def step() -> None:
        optim.zero_grad()
        F.cross_entropy(forward(x), y).backward()
        optim.step()

    return step


def main() -> None:
    torch.set_num_threads(int(os.environ.get("NEOFLOW_NUM_THREADS", "2")))
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch threads "
        f"{torch.get_num_threads()}; median of {RUNS} runs after one warm-up\n"
    )
    print("| model | training step ops | peak live vs naive | neoflow interp step | PyTorch eager step | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    rng = np.random.default_rng(0)
    for name, spec in CASES:
        model = neoflow.compile(MODELS_DIR / name, train=spec)
        plan: MemoryPlan = model.memory["training"]
        batch = _batch(model, rng)
        systems = {"neoflow": lambda model=model, batch=batch: model.train_step(batch)}
        torch_step = _torch_step(name, model, batch)
        if torch_step:
            systems["torch"] = torch_step
        times = interleaved_medians(systems, RUNS)
        ours, theirs = times["neoflow"], times.get("torch")
        peer = f"{theirs * 1e3:.2f} ms" if theirs else "-"
        ratio = f"{theirs / ours:.2f}x" if theirs else "-"
        print(
            f"| {name} | {len(model.training.graph.ops)} | {_size(plan.peak_bytes)} vs {_size(plan.naive_bytes)} "
            f"| {ours * 1e3:.2f} ms | {peer} | {ratio} |"
        )


if __name__ == "__main__":
    main()
