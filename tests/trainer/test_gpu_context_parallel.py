"""Context parallelism over NCCL (gpu tier): the parity check of tests/trainer/test_context_parallel.py
(support.context_parallel_parity) with the GPUs visible, so init_distributed joins the two ranks
over NCCL, one GPU each, and the Ulysses all-to-alls, the group's sums and FSDP2 run on CUDA
tensors. A group of 2 (cp = 2) against the same minibatches unsplit (cp = 1), fp32, on the model
with fewer key/value heads than ranks: the loss within 1e-6 relative and every parameter's
gradient within 1e-5 of its largest entry, for GRPO, GSPO, Dr. GRPO and token-level aggregation;
GSPO with its per-sample sums left unreduced must fail. NCCL refuses two ranks on one GPU, so this
needs two; the ranks run under torchrun (support.torchrun_launch), as the gpu tier's others do.

    bash scripts/test.sh --gpu
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.context_parallel_parity import (
    CASES, GRAD_RTOL, PASSING, WORKER, case_result, check_loss_and_gradients, grad_error, minibatches,
    parity_samples, write_gqa_model, write_spec,
)
from support.torchrun_launch import run_worker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason="needs 2 GPUs: NCCL refuses two ranks on one device"),
]

LAUNCH_TIMEOUT_S = 600
NCCL_CASES = [case for case in CASES if case["model"] == "gqa"]


@pytest.fixture(scope="module")
def nccl_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 ranks over NCCL, one group of 2: the gqa model's cases."""
    model_dir = write_gqa_model(tmp_path_factory.mktemp("tiny-qwen2-mqa"))
    out = tmp_path_factory.mktemp("context-parallel-nccl") / "out"
    args = write_spec(out, {"gqa": model_dir}, parity_samples(model_dir, copies=1), [minibatches()], NCCL_CASES,
                      context_parallel=2)
    run_worker(WORKER, args, nproc=2, timeout_s=LAUNCH_TIMEOUT_S, cuda=True)
    return out


@pytest.mark.parametrize("name", [case["name"] for case in NCCL_CASES if case["name"] in PASSING])
def test_split_loss_and_gradients_equal_unsplit_over_nccl(nccl_out: Path, name: str) -> None:
    result = case_result(nccl_out, name)
    assert result["backend"] == "nccl"
    check_loss_and_gradients(result, name)


def test_gspo_without_the_groups_sums_is_caught_over_nccl(nccl_out: Path) -> None:
    result = case_result(nccl_out, "gspo_unreduced")
    error, _ = grad_error(result["split"]["grads"], result["unsplit"]["grads"])
    assert error > 100 * GRAD_RTOL
