"""Data-parallel training on GPUs: 2 NCCL ranks, one GPU each, train capsule28 as one process does on
the global batch (skipped, with the reason, without two GPUs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from neoflow.runtime.distributed import launch
from tests.runtime.test_distributed import GPU_CASES, WORKER_ENV, check_against_one_process
from tests.targets.cuda.gpu_cases import gpu_reason


def _reason() -> str | None:
    reason = gpu_reason()
    if reason is not None:
        return reason
    import torch

    return None if torch.cuda.device_count() >= 2 else "needs two GPUs"


REASON = _reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def test_two_gpus_train_as_one_process_on_the_global_batch(tmp_path: Path) -> None:
    env = {**WORKER_ENV, "NCCL_NVLS_ENABLE": "0"}
    launch(2, ["-m", "tests.runtime.dp_worker", str(tmp_path), "cuda", *GPU_CASES], env=env)
    for case in GPU_CASES:
        check_against_one_process(tmp_path, case, "cuda", 1e-4)
