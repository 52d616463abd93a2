"""Advantage estimators: from rewards to one advantage per rollout.

Pure maths (numpy only). The experience batcher calls them through `algorithm.prepare_samples`
on each finished group (the rollouts of one (group_id, run_id) pair in a step), or on the whole
step for the batch-normalised estimator:

    grpo          (r - mean_g) / (std_g + eps)        group mean and population std (GRPO)
    dr_grpo       r - mean_g                          no std scaling (Dr. GRPO)
    rloo          r - mean of the group's others      leave-one-out baseline, G/(G-1) (r - mean_g)
    reinforce_pp  (r - mean_B) / (std_B + eps)        over every sample of the step (REINFORCE++)

A group (or step) whose rewards are all equal gets exactly 0 from every estimator, and so does a
group of one under the group estimators (there is nothing to compare it with), so such samples
are countable as carrying no signal.
"""

from __future__ import annotations

from typing import Literal, Sequence

import numpy as np

Estimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"]
ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
STEP_SCOPED_ESTIMATORS: tuple[str, ...] = ("reinforce_pp",)
"""Estimators whose baseline spans the whole step: the batcher holds a step's samples until the
step's generation is done before it can compute them."""


def _all_equal(values: np.ndarray) -> bool:
    # Exactly 0 for equal rewards: the float mean of equal values can be off by an ulp.
    return values.size == 0 or values.min() == values.max()


def group_advantages(rewards: Sequence[float], scale_by_std: bool, eps: float) -> list[float]:
    """GRPO (scale_by_std) or Dr. GRPO advantages of one group's rollouts.

    (r - mean) / (std + eps) when scale_by_std, else r - mean. The std is the population std
    (ddof=0): it is defined for a group of one, and it is what the mean-centred rewards have.
    """
    values = np.asarray(rewards, dtype=np.float64)
    if _all_equal(values):
        return [0.0] * len(rewards)
    centred = values - values.mean()
    if scale_by_std:
        centred = centred / (values.std() + eps)
    return centred.tolist()


def leave_one_out_advantages(rewards: Sequence[float]) -> list[float]:
    """RLOO: each rollout's reward minus the mean reward of the group's other rollouts."""
    values = np.asarray(rewards, dtype=np.float64)
    if _all_equal(values) or values.size == 1:
        return [0.0] * len(rewards)
    others_mean = (values.sum() - values) / (values.size - 1)
    return (values - others_mean).tolist()


def batch_normalised_advantages(rewards: Sequence[float], eps: float) -> list[float]:
    """REINFORCE++: rewards whitened over the whole batch, (r - mean_B) / (std_B + eps)."""
    values = np.asarray(rewards, dtype=np.float64)
    if _all_equal(values):
        return [0.0] * len(rewards)
    return ((values - values.mean()) / (values.std() + eps)).tolist()


def estimate(estimator: Estimator, rewards: Sequence[float], eps: float) -> list[float]:
    """Advantages of one group (group estimators) or one step (reinforce_pp) under `estimator`."""
    if estimator == "grpo":
        return group_advantages(rewards, scale_by_std=True, eps=eps)
    if estimator == "dr_grpo":
        return group_advantages(rewards, scale_by_std=False, eps=eps)
    if estimator == "rloo":
        return leave_one_out_advantages(rewards)
    if estimator == "reinforce_pp":
        return batch_normalised_advantages(rewards, eps)
    raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {list(ESTIMATORS)}")
