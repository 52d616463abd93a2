"""One optimizer step of the system equals a single-process, padded, hand-written GRPO step.

    .venv/bin/python -m pytest tests/trainer/test_step_parity.py -v        # ~1 min on 2 CPU cores

Given one step's samples (rewards, group advantages, reference and sampling logprobs, all
written here), tests/programs/step_parity_worker.py runs the system's step on two
ranks (forked with torchrun's environment, support.forked_ranks): the real FSDP2 model (gloo),
build_optimizer's AdamW and build_scheduler's schedule, the real MinibatchPacker cutting each rank's share into several
token-budgeted packed minibatches (plus padding minibatches with loss weight 0 where the ranks'
counts differ), and trainer_core.run_step (train_on_step, train_again, take_gradient_step with
the gradient scaling: loss x world_size per minibatch, gradients / the step's sample count).

The reference (tests/support/step_parity.py) shares none of that code: a plain HF model from the same checkpoint (eager
attention), one right-padded batch of all samples with an attention mask, logprobs from
log_softmax over the full logits, the loss written from its definition (clipped-ratio policy
gradient, plus kl_coef x k3 = exp(ref - logp) - (ref - logp) - 1, averaged over each sample's
tokens, then over all samples of the step), one backward, clip_grad_norm_, torch.optim.AdamW.
With epochs_per_step > 1 every pass ends in an optimizer step and later passes take the first
pass's detached logprobs as pi_old. Cases: 1 epoch without KL, 1 epoch with k3 KL, 2 epochs with KL,
and the loss options of issue 12: the token-mean and constant aggregations (their divisors are
step totals, so the split over ranks and minibatches must still equal one padded batch) and
GSPO's sequence-level ratio over 2 epochs; and the two-epoch k3 case again with data_path
rank0, where rank 0 scatters every rank's minibatches over the process group, and again with
model.share_prompts, where each minibatch lays a prompt out once before its answers. The
two-epoch k3 case shards the model one FSDP unit per decoder layer, as a larger model is; the
others shard the tiny model as one unit (model.fsdp_per_layer_min_params).

What is compared, and why not only the weights. Adam divides each update by the gradient's own
running RMS, so its first step is about lr x sign(g) wherever |g| >> eps: the weights alone
hardly see a bug that scales every gradient alike (a lost world_size factor, a wrong sample
count), and gradient clipping hides such a bug once more. So each case checks three things:
- the gradient handed to every optimizer step (recorded by a step pre-hook in the worker, after
  the division by the sample count and after clipping), per tensor to GRAD_RTOL and an absolute
  GRAD_ATOL_FRACTION of that tensor's largest gradient;
- the first pass's pre-clip gradient norm (run_step's optim/grad_norm), to GRAD_NORM_RTOL: it
  sees a uniform scale that clipping removes;
- every weight after the step(s), to PARAM_ATOL.
For the weights, float noise in the gradients must not turn into different Adam updates.
Adam's first update of an element is -lr g / (|g| + eps) (bias-corrected m = g, sqrt(v) = |g|),
whose slope in g is at most lr / eps (at g = 0): a gradient error d moves a weight by at most
lr d / eps. With the default eps = 1e-8, a gradient that is ~0 on both sides (float noise of
either sign) could be updated by +lr on one side and -lr on the other. Here the gradient noise
is at most ~3e-8 (measured, unclipped case), so ADAM_EPS = 1e-4 and the step's lr of 1.5e-3
bound the noise's effect on a weight by ~5e-7, an order below PARAM_ATOL = 5e-6 (0.3% of the
step size), while every element with |g| >> 1e-4 (most of them) still gets Adam's normalised
update. Every group has mixed rewards, so every advantage is nonzero and every sample carries
gradient; the weights move by ~300 x PARAM_ATOL, and in pass 2 of the two-epoch case the
clipped term wins for a good share of the tokens, so both branches of the objective count.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo_loss import LossConfig
from sample_processing_utils import Sample
from support.step_parity import (
    CLIP_HIGH, CLIP_LOW, CLIPPING_MAX_NORM, GRAD_NORM_RTOL, GSPO_CLIP, KL_COEF, MAX_TOKENS_PER_GPU,
    MIN_MINIBATCHES_PER_RANK, NO_CLIP, PARAM_ATOL, WORLD_SIZE, Case, assert_grads_close, build_samples,
    load_reference_model, max_diff, optim_config, reference_step, run_cases,
)

CASES = {
    "one_epoch": Case(epochs_per_step=1, loss=LossConfig(clip_low=CLIP_LOW, clip_high=CLIP_HIGH),
                      optim=optim_config(NO_CLIP)),
    "one_epoch_k3": Case(epochs_per_step=1, optim=optim_config(CLIPPING_MAX_NORM),
                         loss=LossConfig(kl_coef=KL_COEF, kl_estimator="k3", clip_low=CLIP_LOW, clip_high=CLIP_HIGH)),
    # Sharded one FSDP unit per decoder layer, as a larger model is; the other cases shard the
    # tiny model as one unit (model.fsdp_per_layer_min_params).
    "two_epochs_k3": Case(epochs_per_step=2, optim=optim_config(CLIPPING_MAX_NORM), per_layer_units=True,
                          loss=LossConfig(kl_coef=KL_COEF, kl_estimator="k3", clip_low=CLIP_LOW, clip_high=CLIP_HIGH)),
    # loss.aggregation: the step's token mean (DAPO) and Dr. GRPO's constant normaliser, split over
    # 2 ranks x several minibatches, against one padded batch; GSPO's sequence-level ratio.
    "token_mean_k3": Case(epochs_per_step=1, optim=optim_config(NO_CLIP),
                          loss=LossConfig(kl_coef=KL_COEF, kl_estimator="k3", aggregation="token_mean")),
    "constant_two_epochs": Case(epochs_per_step=2, optim=optim_config(NO_CLIP),
                                loss=LossConfig(aggregation="constant", clip_low=CLIP_LOW, clip_high=CLIP_HIGH)),
    # data_path rank0: rank 0 reads every rank's minibatches and scatters them (data_path.py);
    # the step must be the same one padded batch.
    "two_epochs_k3_rank0": Case(epochs_per_step=2, optim=optim_config(CLIPPING_MAX_NORM), data_path="rank0",
                                loss=LossConfig(kl_coef=KL_COEF, kl_estimator="k3", clip_low=CLIP_LOW,
                                                clip_high=CLIP_HIGH)),
    "gspo_two_epochs": Case(epochs_per_step=2, optim=optim_config(NO_CLIP),
                            loss=LossConfig(ratio_level="sequence", seq_clip_low=GSPO_CLIP, seq_clip_high=GSPO_CLIP)),
    # model.share_prompts: a minibatch's answers of one prompt after a single copy of it (packed_sdpa).
    "two_epochs_k3_shared_prompts": Case(epochs_per_step=2, optim=optim_config(CLIPPING_MAX_NORM), share_prompts=True,
                                         loss=LossConfig(kl_coef=KL_COEF, kl_estimator="k3", clip_low=CLIP_LOW,
                                                         clip_high=CLIP_HIGH)),
}


@pytest.fixture(scope="module")
def samples(tiny_model_dir: Path) -> list[Sample]:
    return build_samples(tiny_model_dir, seed=0)


@pytest.fixture(scope="module")
def system_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, samples: list[Sample]) -> Path:
    """One launch that runs every case in turn; returns its output folder."""
    return run_cases(tmp_path_factory.mktemp("step-parity"), tiny_model_dir, samples, CASES)


@pytest.mark.distributed
def test_every_rank_trains_on_several_packed_minibatches(system_run: Path, samples: list[Sample]) -> None:
    for name in CASES:
        run = torch.load(system_run / f"{name}.pt")
        per_rank = run["minibatches"]
        assert len(per_rank) == WORLD_SIZE
        for rank, minibatches in enumerate(per_rank):
            carrying = [mb for mb in minibatches if mb["loss_weight"] > 0]
            assert len(carrying) >= MIN_MINIBATCHES_PER_RANK, f"{name}: rank {rank} got {len(carrying)} minibatches"
            for mb in carrying:
                assert sum(samples[i].num_tokens for i in mb["samples"]) <= MAX_TOKENS_PER_GPU
        counts = {len(minibatches) for minibatches in per_rank}
        assert len(counts) == 1, f"{name}: ranks ran different numbers of minibatches {counts}"
        padding = [mb for minibatches in per_rank for mb in minibatches if mb["loss_weight"] == 0]
        assert padding, f"{name}: no padding minibatch, so loss_weight 0 goes untested"
        trained = sorted(i for minibatches in per_rank for mb in minibatches if mb["loss_weight"] > 0
                         for i in mb["samples"])
        assert trained == list(range(len(samples))), f"{name}: not every sample trained exactly once"
        assert run["num_samples"] == len(samples)
        assert run["layer_units"] == CASES[name].per_layer_units, f"{name}: layer_units {run['layer_units']}"
        if CASES[name].share_prompts:  # some minibatch holds answers of one prompt, laid out once
            assert any(len({tuple(samples[i].input_token_ids) for i in mb["samples"]}) < len(mb["samples"])
                       for minibatches in per_rank for mb in minibatches)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
def test_step_equals_padded_single_process_reference(system_run: Path, tiny_model_dir: Path,
                                                     samples: list[Sample], name: str) -> None:
    case = CASES[name]
    run = torch.load(system_run / f"{name}.pt")
    expected = reference_step(tiny_model_dir, samples, case)

    assert run["lr_steps"] == 1 and run["pushed"] == [1], "one schedule step and one weight push per step"
    assert len(run["grads"]) == case.epochs_per_step, "one optimizer step per pass"
    grad_diffs = [assert_grads_close(got, want, f"{name}, pass {epoch + 1}")
                  for epoch, (got, want) in enumerate(zip(run["grads"], expected.grads))]
    assert run["metrics"]["optim/grad_norm"] == pytest.approx(expected.grad_norms[0], rel=GRAD_NORM_RTOL)
    param_diff = max_diff(run["params"], expected.params)
    initial = dict(load_reference_model(tiny_model_dir).named_parameters())
    moved = max_diff(expected.params, initial)
    print(f"{name}: pre-clip grad norms {expected.grad_norms}, clipped-term fraction per pass "
          f"{expected.clipped_fractions}, largest grad difference per pass (fraction of the tensor's largest) "
          f"{grad_diffs}, largest weight difference {param_diff:.2e} (weights moved up to {moved:.2e})")
    assert param_diff <= PARAM_ATOL, f"{name}: weights differ from the reference by {param_diff:.2e}"
    # The check is not vacuous: the step moved the weights far beyond the tolerance, clipping
    # acted where the case asks for it, and a later pass met clipped ratios.
    assert moved > 100 * PARAM_ATOL
    if case.optim.max_grad_norm < NO_CLIP:
        assert expected.grad_norms[0] > case.optim.max_grad_norm
    if case.epochs_per_step > 1:
        assert 0 < expected.clipped_fractions[-1] < 1
