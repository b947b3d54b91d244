"""A worker of the data-parallel tests, started on N ranks by ``neoflow.runtime.distributed.launch``:
``python -m tests.runtime.dp_worker OUT TARGET CASE...``.  Each case trains a model K steps on this rank's
shard of fixed global batches and writes the losses and every parameter and optimizer state
tensor to ``OUT/<case>_<rank>.npz``; ``diverge`` changes a parameter on rank 1 alone and writes
the error the consistency check raised to ``OUT/diverge_<rank>.txt``; ``fail`` makes rank 1 fail
while rank 0 waits in an all-reduce."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import neoflow
from neoflow.errors import InputError
from neoflow.runtime.distributed import DEVICE_TARGETS, DataParallel, DistributedError, join, leave, record_failure
from neoflow.runtime.fusing import DEFAULT_POLICY

STEPS = 3
#: a GPU case's steps: 2 run as queued, then the step captured as a CUDA graph for each of the two
#: sets of parameters taken in turn, and each graph replayed
GPU_STEPS = 6
#: case -> (model, global input shape, optimizer, sync_bn, bucket bytes)
CASES = {
    "mlp_sgd": ("mlp", (32, 64), "sgd", False, 4096),
    "mlp_adam": ("mlp", (32, 64), "adam", False, None),
    "cnn_momentum": ("cnn", (32, 1, 8, 8), "momentum", False, 1024),
    "cnn_adam": ("cnn", (32, 1, 8, 8), "adam", False, None),
    "capsule_sgd": ("capsule", (32, 1, 8, 8), "sgd", False, 1024),
    "capsule_adam": ("capsule", (32, 1, 8, 8), "adam", False, None),
    "bn_sync": ("bn", (6, 2, 5, 5), "sgd", True, None),
    "bn_local": ("bn", (6, 2, 5, 5), "sgd", False, None),
    "capsule_fused": ("capsule", (32, 1, 8, 8), "momentum", False, 1024),
    "capsule28_momentum": ("capsule28", (128, 1, 28, 28), "momentum", False, None),  # a GPU's size
    "capsule28_fused": ("capsule28", (128, 1, 28, 28), "momentum", False, None),
}
#: cases whose pieces are fused under a policy other than the default
FUSION = {"capsule_fused": "neoflow", "capsule28_fused": "neoflow"}
LABELS = {"bn": ("y", 3)}


def model_source(name: str):
    """The model file (or, for ``bn``, the BatchNorm test model) of ``name``."""
    if name == "bn":
        from tests.runtime.test_batchnorm_dropout import _model

        return _model(0.0)
    return str(Path(__file__).resolve().parents[2] / "models" / f"{name}.onnx")


def spec(case: str, lr: float = 0.05) -> neoflow.TrainSpec:
    """The training spec of ``case``."""
    name, _, optimizer, _, _ = CASES[case]
    return neoflow.TrainSpec(optimizer=optimizer, lr=lr, labels=LABELS.get(name, ("labels", 10))[0])


def batches(case: str) -> list[dict[str, np.ndarray]]:
    """The global batches of ``case``, the same on every rank."""
    name, shape, _, _, _ = CASES[case]
    labels, classes = LABELS.get(name, ("labels", 10))
    rng = np.random.default_rng(7)
    return [
        {"x": rng.standard_normal(shape).astype(np.float32), labels: rng.integers(0, classes, shape[0])}
        for _ in range(GPU_STEPS if name == "capsule28" else STEPS)
    ]


def state(model) -> dict[str, np.ndarray]:
    """Every parameter and optimizer state tensor of ``model``, by name."""
    values = model.parameters()
    values.update({f"state:{k}": model._values[k] for k in model.training.state})
    return values


def compile_case(case: str, target: str, batch: int):
    """``case``'s model compiled for ``target`` at ``batch`` (contractions exact on a GPU, so that
    the ranks and one process differ only in the order of their sums), fused as ``FUSION`` says."""
    name, shape, *_ = CASES[case]
    precision = "fp32" if target == "cuda" else None
    return neoflow.compile(
        model_source(name),
        target=target,
        train=spec(case),
        shapes={"x": (batch, *shape[1:])},
        precision=precision,
        fusion=FUSION.get(case, DEFAULT_POLICY),
    )


def run(case: str, out: Path, world, target: str) -> DataParallel:
    _, shape, _, sync_bn, bucket = CASES[case]
    local = shape[0] // world.size
    model = compile_case(case, target, local)
    runner = DataParallel(model, world, bucket_bytes=bucket, sync_bn=sync_bn)
    try:
        runner.last_loss()
        raise AssertionError("last_loss() before any step answered")
    except InputError as err:
        assert "no training step has run yet" in str(err), err
    losses = []
    for batch in batches(case):
        shard = {k: v[world.rank * local : (world.rank + 1) * local] for k, v in batch.items()}
        returned = runner.train_step(shard, wait=False)  # a GPU run queues the step and returns
        losses.append(runner.last_loss())
        assert returned is None if target in DEVICE_TARGETS else returned == losses[-1], returned
    runner.synchronize()  # parameters kept on a GPU back into the model
    if target in DEVICE_TARGETS:  # the pieces write a bucket's tensors into its buffer, each aligned
        views = [view for layout in runner.arrays.layouts.values() for view in layout]
        assert views and all(view.data_ptr() % runner.arrays.ALIGN == 0 for view in views)
    np.savez(out / f"{case}_{world.rank}.npz", losses=np.array(losses), **state(model))
    (out / f"{case}_{world.rank}.segments").write_text(str(len(runner.split.segments)))
    return runner


def main(argv: list[str]) -> None:
    out, target = Path(argv[0]), argv[1]
    world = join(target)
    try:
        for case in argv[2:]:
            if case == "fail":
                if world.rank == 1:
                    record_failure("neoflow: input error: rank 1 gives up")  # as the CLI does
                    raise SystemExit(1)
                import torch.distributed as dist

                dist.all_reduce(__import__("torch").zeros(1))  # waits for rank 1, which never comes
            elif case == "diverge":
                runner = run("mlp_sgd", out, world, target)
                if world.rank == 1:
                    runner.model.set_parameters({"w1": runner.model.parameters()["w1"] + 1e-3})
                try:
                    runner.check_consistent()
                    message = "no error"
                except DistributedError as err:
                    message = str(err)
                (out / f"diverge_{world.rank}.txt").write_text(message)
            else:
                run(case, out, world, target)
    finally:
        leave()


if __name__ == "__main__":
    main(sys.argv[1:])
