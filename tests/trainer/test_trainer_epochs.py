"""epochs_per_step: the trainer's later passes against a PPO-epoch loop written here.

The trainer path (train_on_step keeping its minibatches, then update_for_step: take_gradient_step,
train_again, take_gradient_step, one lr-schedule step) runs on a TokenLogprobModel in one process,
fed by a stand-in batcher. The reference is written independently: each sample scored alone by a
plain HF forward, the clipped-ratio loss by hand, plain SGD (Adam would turn float noise in
near-zero gradients into visible weight differences). After two optimizer steps on one batch both
models must hold the same weights,
and the second step must have moved them differently from a repeat of the first (ratios != 1).
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from async_grpo.data.dataset import DatasetConfig
from async_grpo.model.packed_attention import PACKED_SDPA
from async_grpo.telemetry.metrics import StepAccumulator
from async_grpo.trainer.config import TrainerConfig
from async_grpo.trainer.data_path import PerRankDataPath, RayBatcherClient
from async_grpo.trainer.fsdp_setup import DistInfo
from async_grpo.trainer.optimizer import OptimConfig, build_scheduler
from grpo_loss import LossConfig
from sample_processing_utils import Sample
from setup_model import TokenLogprobModel, load_causal_lm
from support.reference_logprobs import reference_logprobs
from async_grpo.trainer.policy_update import KeptMinibatch, train_on_step, update_for_step
from vllm_experience_batcher import EndOfStep, Minibatch

LR = 0.1  # SGD: moves most second-pass ratios past the clip bounds, so both branches are exercised
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
PARAM_ATOL = 2e-5


def _samples(vocab: int, seed: int, groups_of: int = 1) -> list[Sample]:
    """Six samples; consecutive ones share their prompt in groups of `groups_of` (GRPO's answers)."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(6):
        prompt = torch.randint(2, vocab, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen).tolist()
        if i % groups_of:
            prompt = samples[-1].input_token_ids
        output = torch.randint(2, vocab, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist()
        samples.append(Sample(input_token_ids=prompt, output_token_ids=output, gt_answer="", prompt_id=i,
                              sampling_logprobs=[0.0] * len(output), advantage=float(torch.randn(1, generator=gen))))
    return samples


def _reference_two_epochs(causal_lm: torch.nn.Module, samples: list[Sample]) -> None:
    """Two SGD steps on one batch, PPO style: pass 2 clips exp(logp - logp_pass1) * A."""
    optimizer = torch.optim.SGD(causal_lm.parameters(), lr=LR)
    old: list[torch.Tensor] = []
    for epoch in range(2):
        optimizer.zero_grad()
        total = torch.zeros(())
        for i, sample in enumerate(samples):
            logp = reference_logprobs(causal_lm, sample.input_token_ids, sample.output_token_ids, grad=True)
            if epoch == 0:
                old.append(logp.detach())
            ratio = torch.exp(logp - old[i])
            adv = sample.advantage
            pg = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * adv)
            total = total + pg.mean()
        (total / len(samples)).backward()
        torch.nn.utils.clip_grad_norm_(causal_lm.parameters(), 1e9)
        optimizer.step()


@pytest.mark.parametrize("share_prompts", [False, True], ids=["whole", "shared-prompts"])
@pytest.mark.parametrize("split", [1, 2], ids=["one-minibatch", "two-minibatches"])
def test_later_passes_match_a_hand_written_ppo_epoch_loop(tiny_model_dir: Path, monkeypatch, split: int,
                                                          share_prompts: bool) -> None:
    torch.manual_seed(0)
    attn = PACKED_SDPA if share_prompts else "eager"
    causal_lm = load_causal_lm(tiny_model_dir, dtype=torch.float32, attn_implementation=attn)
    reference_lm = copy.deepcopy(causal_lm)
    samples = _samples(causal_lm.config.vocab_size, seed=split, groups_of=3 if share_prompts else 1)
    model = TokenLogprobModel(causal_lm)

    # The batcher stand-in: its next_message.remote(...) returns the message itself, and ray.get
    # hands it through (this test has no Ray cluster; the transport is not what is tested).
    chunks = [samples[:3], samples[3:]] if split == 2 else [samples]
    messages = iter([Minibatch(step=0, rank=0, index=i, samples=c, loss_weight=1.0) for i, c in enumerate(chunks)]
                    + [EndOfStep(step=0, num_samples=len(samples), num_tokens=sum(s.num_tokens for s in samples),
                                 num_minibatches=len(chunks), num_prompts=len(samples), timed_out_prompts=0,
                                 dropped_stale=0, oversized_samples=0, padding_minibatches=0, missing_rollouts=0)])
    batcher = SimpleNamespace(next_message=SimpleNamespace(remote=lambda rank, step: next(messages)))
    import ray

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    optim_config = OptimConfig(lr=LR, weight_decay=0.0, warmup_steps=0, max_grad_norm=1e9)
    config = SimpleNamespace(message_timeout_s=1.0, loss=LossConfig(clip_low=CLIP_LOW, clip_high=CLIP_HIGH),
                             epochs_per_step=2, optim=optim_config, model=SimpleNamespace(share_prompts=share_prompts))
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = build_scheduler(optimizer, optim_config)
    acc = StepAccumulator(step=0)
    kept: list[KeptMinibatch] = []

    end = train_on_step(model, PerRankDataPath(RayBatcherClient(batcher), [], dist), 0, config, dist, acc, keep=kept)
    assert len(kept) == len(chunks) and all(k.batch.old_logprobs is not None for k in kept)
    update_for_step(model, optimizer, scheduler, kept, end.num_samples, config, dist, acc)

    _reference_two_epochs(reference_lm, samples)
    got = dict(causal_lm.named_parameters())
    worst = max((got[name] - p).abs().max().item() for name, p in reference_lm.named_parameters())
    assert worst <= PARAM_ATOL, f"parameters differ from the reference by {worst:.2e}"
    # The second pass saw the policy moved: ratios away from 1, and the metric says so.
    assert acc.sums["later_tokens"] == sum(len(s.output_token_ids) for s in samples)
    ratio_mean = acc.sums["later_ratio_sum"] / acc.sums["later_tokens"]
    print(f"pass 2: ratio mean {ratio_mean:.4f}, clip fraction {acc.sums['later_clip_sum'] / acc.sums['later_tokens']:.3f}, "
          f"max weight diff vs reference {worst:.2e}")
    assert abs(ratio_mean - 1.0) > 1e-2
    assert scheduler.last_epoch == 1  # the lr schedule advanced once for the step, not per pass


def test_epochs_per_step_must_be_positive() -> None:
    with pytest.raises(ValueError, match="epochs_per_step"):
        TrainerConfig(model=SimpleNamespace(), data=DatasetConfig(path="unused.jsonl"), epochs_per_step=0)
