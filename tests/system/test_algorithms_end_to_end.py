"""The algorithm options on the real system: vLLM generation worker, an old-policy logprob worker,
a reference-pool worker and a teacher worker (all through worker_dispatcher.py), the batcher and
`torchrun --nproc_per_node=2 trainer_core.py`.

One run turns on what needs the extra services together: KL in the reward with the adaptive
controller and the old-policy side of the KL (reference logprobs from the reference pool),
on-policy distillation from a teacher pool (the teacher is the student's starting model, so the
reverse KL starts near 0), the token-mean aggregation and GSPO's ratio (dynamic sampling's real
path is tests/system/test_crash_resume.py's). It
checkpoints, and a resumed run continues with the controller's beta computed here by hand.

    .venv/bin/python -m pytest tests/system/test_algorithms_end_to_end.py -x -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

from local_cluster import LocalCluster
from support.cluster import cluster_config, started_cluster, train

pytestmark = [pytest.mark.vllm, pytest.mark.distributed, pytest.mark.system]

KL_COEF, TARGET_KL, HORIZON = 0.05, 0.01, 100
# On top of support.cluster.FAST_RUN's small steps (2 ranks x 4 prompts x 4 rollouts):
RUN = ["--max_lag", "1", "--epochs_per_step", "2", "--optim.schedule", "constant", "--optim.warmup_steps", "0",
       "--logprob_role", "old_policy", "--reference_pool", "true",
       "--loss.kl_coef", str(KL_COEF), "--loss.kl_in_reward", "true", "--loss.kl_controller", "adaptive",
       "--loss.target_kl", str(TARGET_KL), "--loss.kl_horizon", str(HORIZON), "--loss.kl_policy_logprobs", "old_policy",
       "--algorithm.estimator", "dr_grpo", "--loss.aggregation", "token_mean", "--loss.ratio_level", "sequence",
       "--distill.teacher", "true", "--distill.coef", "0.5"]
SAMPLES_PER_STEP = 2 * 4 * 4  # ranks x prompts x rollouts


@pytest.fixture(scope="module")
def cluster(demo_assets: Path, tmp_path_factory: pytest.TempPathFactory):
    model = demo_assets / "model"
    config = cluster_config(model, tmp_path_factory.mktemp("worker-logs"), reference_workers=1, teacher_workers=1,
                            teacher_model_path=str(model))
    with started_cluster(config) as running:
        yield running


def _train(cluster: LocalCluster, demo_assets: Path, run_dir: Path, *extra: str) -> list[dict]:
    return train(cluster, demo_assets, run_dir, *RUN, *extra)


def test_every_service_at_once_then_resume_with_the_controllers_beta(cluster: LocalCluster, demo_assets: Path,
                                                                     tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = _train(cluster, demo_assets, run, "--num_steps", "2", "--checkpoint_at_end", "true")
    assert [r["step"] for r in first] == [0, 1]
    step0 = first[0]
    # The teacher is the student's starting model: at step 0 the reverse KL is only the sampler's
    # float-level difference from the teacher's forward.
    assert abs(step0["distill/reverse_kl"]) < 1e-3, step0["distill/reverse_kl"]
    assert step0["timing/teacher_s"] > 0 and step0["kl/beta"] == pytest.approx(KL_COEF)
    for record in first:
        assert record["counts/samples"] == SAMPLES_PER_STEP
        assert record["kl/in_reward_mean"] >= -1e-3  # old policy vs reference: a KL, ~0 before training
        assert record["loss/ratio_mean"] > 0 and "mismatch/kl" in record

    resumed = _train(cluster, demo_assets, run, "--num_steps", "3", "--resume", "true")
    assert [r["step"] for r in resumed] == [0, 1, 2]
    # max_lag 1: step 2 uses beta after step 0's update, by hand from step 0's logged KL and samples.
    error = min(max(step0["kl/in_reward_mean"] / TARGET_KL - 1.0, -0.2), 0.2)
    expected = KL_COEF * (1.0 + error * step0["counts/samples"] / HORIZON)
    assert resumed[2]["kl/beta"] == pytest.approx(expected, rel=1e-9)
    assert resumed[2]["kl/beta"] != KL_COEF
