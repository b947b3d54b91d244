"""A training loop over a data set: epochs of shuffled batches, accuracy on a test split."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from neoflow.errors import InputError
from neoflow.runtime.compiled import CompiledModel
from neoflow.runtime.datasets import Dataset, fit_samples

if TYPE_CHECKING:
    from neoflow.runtime.distributed import DataParallel


@dataclass(frozen=True)
class Progress:
    """Where a running epoch stands (what a progress bar shows)."""

    epoch: int
    batch: int
    batches: int
    loss: float
    accuracy: float | None
    samples_per_second: float


@dataclass(frozen=True)
class EpochResult:
    """One finished epoch: mean training loss and accuracy, test accuracy, time."""

    epoch: int
    loss: float
    train_accuracy: float | None
    test_accuracy: float | None
    seconds: float
    samples_per_second: float


class Trainer:
    """Feeds a data set to a ``CompiledModel`` compiled with a training step.

    The model's one data input takes the samples (reshaped to its per-sample
    shape); its labels input the labels (integer labels become one-hot for an
    MSE loss on a [batch, classes] output).  Batches have the size the model
    was compiled for; a last partial batch of an epoch is dropped.

    With a ``DataParallel`` ``runner`` every rank draws the same shuffled global batches (the
    model's batch times the ranks) and steps on its own shard of each; the test accuracy is
    counted on rank 0 only, the training accuracy from each rank's own shards."""

    def __init__(self, model: CompiledModel, data: Dataset, seed: int = 0, runner: DataParallel | None = None) -> None:
        training = model.training
        if training is None:
            raise InputError("the model was compiled without a training step (neoflow compile --train)")
        if len(training.data_inputs) != 1:
            names = ", ".join(model.public_name(t.name) for t in training.data_inputs)
            raise InputError(f"training from a data set feeds one data input; the model has: {names or 'none'}")
        if training.labels is None:
            raise InputError("training from a data set needs a loss with labels (cross_entropy or mse)")
        self.model = model
        self.input = training.data_inputs[0]
        self.input_name = model.public_name(self.input.name)
        self.batch = self.input.shape[0]
        self.labels = training.labels
        self.x_train = fit_samples(data.x_train, self.input, self.input_name)
        self.x_test = fit_samples(data.x_test, self.input, self.input_name)
        self.y_train, self.y_test = self._labels(data.y_train), data.y_test
        self.classify = len(model.training.graph.tensors[training.prediction].shape) == 2
        # the training accuracy is counted from the steps' predictions, when the model keeps them
        self.count_training = self.classify and model.spec.keep_prediction
        self.runner = runner
        self.ranks, self.rank = (runner.world.size, runner.world.rank) if runner is not None else (1, 0)
        self.global_batch = self.batch * self.ranks
        if len(self.x_train) < self.global_batch:
            raise InputError(
                f"the data set has {len(self.x_train)} training samples, fewer than one batch ({self.global_batch})"
            )
        self.rng = np.random.default_rng(seed)

    def _labels(self, y: np.ndarray) -> np.ndarray:
        shape = self.labels.shape[1:]
        if self.labels.dtype == "int64":
            return y.astype(np.int64)
        if y.ndim == 1 and len(shape) == 1 and np.issubdtype(y.dtype, np.integer):
            return np.eye(shape[0], dtype=np.float32)[y]
        return y.astype(np.float32)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Model outputs for all samples ``x`` (batched; the last batch padded)."""
        outputs = []
        for start in range(0, len(x), self.batch):
            chunk = x[start : start + self.batch]
            padded = np.zeros((self.batch, *chunk.shape[1:]), np.float32)
            padded[: len(chunk)] = chunk
            result = self.model.run({self.input_name: padded})
            outputs.append(next(iter(result.values()))[: len(chunk)])
        return np.concatenate(outputs)

    def test_accuracy(self) -> float | None:
        """Fraction of test samples whose arg-max prediction is their label."""
        if not self.classify or len(self.x_test) == 0 or self.rank != 0:
            return None
        return float((self.predict(self.x_test).argmax(axis=1) == self.y_test).mean())

    def epoch(self, number: int, on_progress: Callable[[Progress], None] | None = None) -> EpochResult:
        """Train one epoch over shuffled batches."""
        order = self.rng.permutation(len(self.x_train))
        batches = len(order) // self.global_batch
        step = self.model.train_step if self.runner is None else self.runner.train_step
        losses, correct, seen, counted = [], 0, 0, 0
        start = time.perf_counter()
        for b in range(batches):
            shard = b * self.global_batch + self.rank * self.batch
            pick = order[shard : shard + self.batch]
            loss = step({self.input_name: self.x_train[pick], self.model.spec.labels: self.y_train[pick]}, check=True)
            losses.append(loss)
            seen += self.global_batch
            if self.count_training:
                truth = self.y_train[pick] if self.y_train.ndim == 1 else self.y_train[pick].argmax(axis=1)
                correct += int((self.model.last_prediction.argmax(axis=1) == truth).sum())
                counted += len(pick)
            if on_progress is not None:
                elapsed = time.perf_counter() - start
                on_progress(
                    Progress(
                        number,
                        b + 1,
                        batches,
                        float(np.mean(losses)),
                        correct / counted if self.count_training else None,
                        seen / elapsed if elapsed else 0.0,
                    )
                )
        seconds = time.perf_counter() - start
        if self.runner is not None:
            self.runner.synchronize()  # parameters kept on a GPU back into the model
        return EpochResult(
            number,
            float(np.mean(losses)),
            correct / counted if self.count_training else None,
            self.test_accuracy(),
            seconds,
            seen / seconds if seconds else 0.0,
        )
