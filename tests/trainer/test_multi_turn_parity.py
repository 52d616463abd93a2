"""A step on multi-turn samples equals a padded, hand-written step with the same masks.

    .venv/bin/python -m pytest tests/trainer/test_multi_turn_parity.py -v     # ~1 min on 2 CPU cores

The samples are multi-turn rollouts: each output is model turns with environment observations
between them (Sample.output_mask False), so only some output tokens are sampled. The system's step
runs exactly as in tests/trainer/test_step_parity.py (its worker,
tests/programs/step_parity_worker.py, on two forked ranks: the real FSDP2 model,
MinibatchPacker cutting each rank's share into several token-budgeted packed minibatches,
trainer_core.run_step); this module reuses that launcher and the step written from its definition
(support.step_parity's `reference_step`, whose loss reads a PaddedBatch's mask). What is new and written here
by hand is the padded batch of multi-turn samples: the observation tokens are in every row's input
(the policy conditions on them) but its mask is 1 only where a position predicts a *sampled* token,
and the reference logprobs sit at exactly those positions. So every per-sample normaliser
(sample_mean's token count, GSPO's mean log ratio), the step's token count (token_mean), KL and the
clipped ratio count sampled tokens, with no code of the system's packing involved.

A system that trained the observation tokens (labels on them, lengths counting them) would see a
different loss and different gradients: the check below is of the gradients per pass, the first
pass's gradient norm and the weights, to test_step_parity's tolerances.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo_loss import LossConfig
from sample_processing_utils import Sample
from support.step_parity import (
    CLIP_HIGH, CLIP_LOW, CLIPPING_MAX_NORM, GRAD_NORM_RTOL, GSPO_CLIP, KL_COEF, MAX_OUTPUT_TOKENS,
    MIN_MINIBATCHES_PER_RANK, NO_CLIP, PARAM_ATOL, PROMPT_LEN_RANGE, WORLD_SIZE, Case, PaddedBatch, assert_grads_close,
    group_advantages, load_reference_model, max_diff, optim_config, reference_step, run_cases, token_logprobs,
)

NUM_PROMPTS = 6
GROUP_SIZE = 4
FIRST_TOKEN_ID = 2  # ids 0 and 1 are EOS and PAD in the tiny tokenizer
TURNS_RANGE = (2, 4)  # [low, high) model turns per rollout, an observation between each two
TURN_LEN_RANGE = (1, 6)
OBSERVATION_LEN_RANGE = (1, 5)
REF_LOGPROB_NOISE = 0.3
SAMPLING_LOGPROB_NOISE = 0.1

CASES = {
    "one_epoch_k3": Case(epochs_per_step=1, optim=optim_config(CLIPPING_MAX_NORM),
                         loss=LossConfig(kl_coef=KL_COEF, kl_estimator="k3", clip_low=CLIP_LOW, clip_high=CLIP_HIGH)),
    "token_mean_k3": Case(epochs_per_step=1, optim=optim_config(NO_CLIP),
                          loss=LossConfig(kl_coef=KL_COEF, kl_estimator="k3", aggregation="token_mean")),
    # rank 0 scatters every rank's minibatches: the output_mask must survive data_path's codec.
    "two_epochs_k3_rank0": Case(epochs_per_step=2, optim=optim_config(CLIPPING_MAX_NORM), data_path="rank0",
                                loss=LossConfig(kl_coef=KL_COEF, kl_estimator="k3", clip_low=CLIP_LOW,
                                                clip_high=CLIP_HIGH)),
    "gspo_two_epochs": Case(epochs_per_step=2, optim=optim_config(NO_CLIP),
                            loss=LossConfig(ratio_level="sequence", seq_clip_low=GSPO_CLIP, seq_clip_high=GSPO_CLIP)),
}


def _masked_padded_batch(samples: list[Sample], pad_id: int) -> PaddedBatch:
    """Right-padded rows of prompt + every output token; the mask marks positions whose next
    token is a sampled output token (written out here, without the system's packing)."""
    length = max(len(s.input_token_ids) + len(s.output_token_ids) for s in samples)
    ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), length), dtype=torch.long)
    mask = torch.zeros((len(samples), length - 1))
    ref = torch.zeros((len(samples), length - 1))
    for i, s in enumerate(samples):
        sequence = s.input_token_ids + s.output_token_ids
        ids[i, : len(sequence)] = torch.tensor(sequence)
        attention[i, : len(sequence)] = 1
        sampled_positions = [len(s.input_token_ids) + j - 1 for j, sampled in enumerate(s.output_mask) if sampled]
        mask[i, sampled_positions] = 1.0
        if s.ref_logprobs is not None:
            ref[i, sampled_positions] = torch.tensor(s.ref_logprobs)
    return PaddedBatch(input_ids=ids, attention_mask=attention, targets=ids[:, 1:], output_mask=mask,
                       advantages=torch.tensor([s.advantage for s in samples]), ref_logprobs=ref)


def build_samples(model_dir: Path, seed: int) -> list[Sample]:
    """Groups of multi-turn rollouts (turn, observation, turn, ...), mixed 0/1 rewards, reference
    and sampling logprobs near the starting model's at the sampled tokens."""
    gen = torch.Generator().manual_seed(seed)
    model = load_reference_model(model_dir)
    vocab = model.config.vocab_size

    def randint(low_high: tuple[int, int]) -> int:
        return int(torch.randint(*low_high, (1,), generator=gen))

    def tokens(n: int) -> list[int]:
        return torch.randint(FIRST_TOKEN_ID, vocab, (n,), generator=gen).tolist()

    samples = []
    for prompt_id in range(NUM_PROMPTS):
        prompt = tokens(randint(PROMPT_LEN_RANGE))
        rewards = [float(r) for r in torch.randint(0, 2, (GROUP_SIZE,), generator=gen)]
        rewards[0] = 1.0 - rewards[1]
        for reward, advantage in zip(rewards, group_advantages(rewards)):
            output: list[int] = []
            mask: list[bool] = []
            for turn in range(randint(TURNS_RANGE)):
                if turn:
                    observation = tokens(randint(OBSERVATION_LEN_RANGE))
                    output += observation
                    mask += [False] * len(observation)
                sampled = tokens(randint(TURN_LEN_RANGE))
                output += sampled
                mask += [True] * len(sampled)
            samples.append(Sample(input_token_ids=prompt, output_token_ids=output, output_mask=mask, gt_answer="",
                                  prompt_id=prompt_id, reward=reward, advantage=advantage, weight_version=0))
    batch = _masked_padded_batch(samples, pad_id=model.config.pad_token_id)
    with torch.no_grad():
        current = token_logprobs(model, batch)
    for i, s in enumerate(samples):
        own = current[i][batch.output_mask[i].bool()]
        s.ref_logprobs = (own + REF_LOGPROB_NOISE * torch.randn(own.shape, generator=gen)).tolist()
        s.sampling_logprobs = (own + SAMPLING_LOGPROB_NOISE * torch.randn(own.shape, generator=gen)).tolist()
    return samples


@pytest.fixture(scope="module")
def samples(tiny_model_dir: Path) -> list[Sample]:
    return build_samples(tiny_model_dir, seed=1)


@pytest.fixture(scope="module")
def system_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, samples: list[Sample]) -> Path:
    return run_cases(tmp_path_factory.mktemp("multi-turn-parity"), tiny_model_dir, samples, CASES)


def test_the_samples_are_multi_turn_and_fit_the_budgets(samples: list[Sample]) -> None:
    longest_output = (TURNS_RANGE[1] - 1) * (TURN_LEN_RANGE[1] - 1) + (TURNS_RANGE[1] - 2) * (OBSERVATION_LEN_RANGE[1] - 1)
    assert longest_output <= MAX_OUTPUT_TOKENS  # the worker's budget holds the longest prompt + output
    with_observations = [s for s in samples if False in s.output_mask]
    assert len(with_observations) >= len(samples) // 2, "too few multi-turn samples to test the mask"


@pytest.mark.distributed
def test_every_rank_trains_on_several_packed_minibatches(system_run: Path, samples: list[Sample]) -> None:
    for name in CASES:
        run = torch.load(system_run / f"{name}.pt")
        assert len(run["minibatches"]) == WORLD_SIZE
        for rank, minibatches in enumerate(run["minibatches"]):
            carrying = [mb for mb in minibatches if mb["loss_weight"] > 0]
            assert len(carrying) >= MIN_MINIBATCHES_PER_RANK, f"{name}: rank {rank} got {len(carrying)} minibatches"
        trained = sorted(i for minibatches in run["minibatches"] for mb in minibatches if mb["loss_weight"] > 0
                         for i in mb["samples"])
        assert trained == list(range(len(samples)))


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
def test_multi_turn_step_equals_padded_masked_reference(system_run: Path, tiny_model_dir: Path,
                                                        samples: list[Sample], name: str) -> None:
    case = CASES[name]
    run = torch.load(system_run / f"{name}.pt")
    expected = reference_step(tiny_model_dir, samples, case, make_batch=_masked_padded_batch)
    assert len(run["grads"]) == case.epochs_per_step
    grad_diffs = [assert_grads_close(got, want, f"{name}, pass {epoch + 1}")
                  for epoch, (got, want) in enumerate(zip(run["grads"], expected.grads))]
    assert run["metrics"]["optim/grad_norm"] == pytest.approx(expected.grad_norms[0], rel=GRAD_NORM_RTOL)
    param_diff = max_diff(run["params"], expected.params)
    moved = max_diff(expected.params, dict(load_reference_model(tiny_model_dir).named_parameters()))
    print(f"{name}: largest grad difference per pass {grad_diffs}, weight difference {param_diff:.2e} "
          f"(weights moved up to {moved:.2e}), clipped fractions {expected.clipped_fractions}")
    assert param_diff <= PARAM_ATOL
    assert moved > 100 * PARAM_ATOL
    if case.epochs_per_step > 1:
        assert 0 < expected.clipped_fractions[-1] < 1
