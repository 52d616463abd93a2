"""Advantage estimators: from one prompt's group of rewards to one advantage per rollout.

Pure maths (numpy only): the generation worker calls it on every finished group.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def group_advantages(rewards: Sequence[float], scale_by_std: bool, eps: float) -> list[float]:
    """Group-relative advantages of one prompt's rollouts.

    (r - mean) / (std + eps) when scale_by_std, else r - mean. The std is the population std
    (ddof=0): it is defined for a group of one, and it is what the mean-centred rewards have.
    """
    if not rewards:
        return []
    values = np.asarray(rewards, dtype=np.float64)
    if values.min() == values.max():
        # Exactly 0 (the float mean of equal values can be off by an ulp), so such groups are countable.
        return [0.0] * len(rewards)
    centred = values - values.mean()
    if scale_by_std:
        centred = centred / (values.std() + eps)
    return centred.tolist()
