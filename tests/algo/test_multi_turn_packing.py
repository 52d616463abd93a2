"""Packing respects Sample.output_mask: observation tokens are context, never labels.

    .venv/bin/python -m pytest tests/algo/test_multi_turn_packing.py -q

Every expected value below is written by hand from the layout in sample_processing_utils'
module docstring, not computed by the code under test.
"""

from __future__ import annotations

import pytest
import torch

from async_grpo.algo.algorithm import PreparedSamples, check_prepared
from async_grpo.rewards.math_verifier import RewardResult
from async_grpo.rollouts.rollout_scoring import shaped_rewards
from async_grpo.config.sampling import SamplingConfig
from sample_processing_utils import Sample, get_input_for_logprobs, post_process_batch, split_per_sample


def _multi_turn() -> Sample:
    """Prompt [1, 2]; output: sampled 10 11, observation 20 21 22, sampled 12."""
    return Sample(input_token_ids=[1, 2], gt_answer="", prompt_id=7, output_token_ids=[10, 11, 20, 21, 22, 12],
                  output_mask=[True, True, False, False, False, True], sampling_logprobs=[-0.1, -0.2, -0.3],
                  advantage=0.5)


def _single_turn() -> Sample:
    return Sample(input_token_ids=[3, 4, 5], gt_answer="", prompt_id=8, output_token_ids=[30, 31],
                  sampling_logprobs=[-1.0, -2.0], advantage=-1.0)


def test_observation_tokens_are_context_but_never_labels() -> None:
    inputs = get_input_for_logprobs([_multi_turn(), _single_turn()])
    assert inputs.input_ids.tolist() == [1, 2, 10, 11, 20, 21, 22, 12, 3, 4, 5, 30, 31]
    assert inputs.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4]
    # Position 1 (token 2) predicts 10, 2 predicts 11; 3, 4, 5 predict observation tokens (no
    # target); 6 (token 22) predicts the sampled 12; 7, the sample's last token, predicts nothing.
    assert inputs.output_indices.tolist() == [1, 2, 6, 10, 11]
    assert inputs.targets.tolist() == [10, 11, 12, 30, 31]
    assert inputs.output_lengths == [3, 2]


def test_without_a_mask_packing_is_unchanged() -> None:
    plain = _single_turn()
    all_sampled = _single_turn()
    all_sampled.output_mask = [True, True]
    for sample in (plain, all_sampled):
        inputs = get_input_for_logprobs([sample])
        assert inputs.output_indices.tolist() == [2, 3]
        assert inputs.targets.tolist() == [30, 31]
        assert inputs.output_lengths == [2]


def test_packed_batch_counts_sampled_tokens_but_the_stream_holds_all() -> None:
    samples = [_multi_turn(), _single_turn()]
    batch = post_process_batch(samples)
    assert batch.num_tokens == 13 == sum(s.num_tokens for s in samples)  # the batcher's budgets: every token
    assert batch.advantages.tolist() == [0.5, 0.5, 0.5, -1.0, -1.0]
    assert batch.output_lengths.tolist() == [3.0, 3.0, 3.0, 2.0, 2.0]
    assert batch.output_lengths_per_sample.tolist() == [3.0, 2.0]
    assert batch.sample_index.tolist() == [0, 0, 0, 1, 1]
    assert batch.sampling_logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.3, -1.0, -2.0])
    per_sample = split_per_sample(torch.arange(5, dtype=torch.float32), batch.inputs.output_lengths)
    assert per_sample == [[0.0, 1.0, 2.0], [3.0, 4.0]]


def test_token_advantages_and_logprobs_are_one_per_sampled_token() -> None:
    sample = _multi_turn()
    sample.token_advantages = [1.0, 2.0, 3.0]
    batch = post_process_batch([sample])
    assert batch.advantages.tolist() == [1.0, 2.0, 3.0]
    check_prepared(PreparedSamples(samples=[sample]), [sample], "test")
    sample.token_advantages = [1.0] * 6  # one per output token, observations included: wrong
    with pytest.raises(ValueError, match="6 token_advantages for 3 output tokens the engine sampled"):
        check_prepared(PreparedSamples(samples=[sample]), [sample], "test")
    sample.token_advantages = None
    sample.sampling_logprobs = [-0.1] * 6
    with pytest.raises(ValueError, match="sampling_logprobs has 6 entries for 3 sampled"):
        post_process_batch([sample])


def test_overlong_punishment_counts_the_models_own_tokens() -> None:
    """Observation tokens are not the policy's length: a rollout of 3 sampled tokens and 3
    observation tokens is not overlong at max_tokens 4."""
    sampling = SamplingConfig(max_tokens=4, overlong_buffer=1, overlong_penalty=1.0)
    sample = _multi_turn()
    sample.output_text = "x"
    (shaped,) = shaped_rewards([sample], [RewardResult(reward=1.0, failed=False, error="")], sampling)
    assert shaped.reward == 1.0
    sample.output_mask = None  # the same six tokens all sampled: 2 past the buffer's start
    sample.sampling_logprobs = [-0.1] * 6
    (shaped,) = shaped_rewards([sample], [RewardResult(reward=1.0, failed=False, error="")], sampling)
    assert shaped.reward == 0.0
