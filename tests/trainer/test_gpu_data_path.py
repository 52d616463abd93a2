"""The rank-0 data path over NCCL (gpu tier): a dead or hung rank 0 surfaces as Rank0DataPathError.

The same scenarios as tests/trainer/test_data_path.py's gloo test
(tests/programs/data_path_worker.py, rank0_dies / rank0_hangs), with the GPUs visible, so
init_distributed joins the two ranks over NCCL, one GPU each. Without the asynchronous collective
and its timed wait, rank 1 would block until NCCL's watchdog aborted it (no error of ours, exit by
signal) and the check would fail. NCCL refuses two ranks on one GPU, so this needs two.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.data_path_launch import DIST_TIMEOUT_S, check_rank0_gone, launch_pair

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason="needs 2 GPUs: NCCL refuses two ranks on one device"),
]


@pytest.mark.parametrize("scenario", ["rank0_dies", "rank0_hangs"])
def test_rank0_gone_over_nccl_raises_rank0_data_path_error(tmp_path: Path, scenario: str) -> None:
    result, elapsed = launch_pair(scenario, tmp_path, DIST_TIMEOUT_S, cuda=True)
    print(f"{scenario} over NCCL: rank 1 stopped after {elapsed:.1f} s (process start included)")
    check_rank0_gone(result, "nccl")
