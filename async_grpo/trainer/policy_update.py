"""One step's policy update on a trainer rank: forward/backward every minibatch of the step as
the batcher sends it (train_on_step), the further epochs over the kept minibatches and the
gradient steps (update_for_step).

Gradient scaling: each minibatch's loss is a sum over its samples (or tokens, see
loss.aggregation); it is multiplied by world_size (FSDP averages gradients over ranks) and the
summed gradients are divided by the step's divisor (its total sample count, output-token count,
or samples x max_tokens: grpo_loss.step_divisor), which equals one backward over the loss of all
the step's samples at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LRScheduler

from async_grpo.batching.batcher_messages import EndOfStep, Minibatch, PromptRequest
from async_grpo.model.context_parallel import gather_outputs, local_batch, reduce_loss_metrics
from async_grpo.telemetry.metrics import StepAccumulator
from async_grpo.trainer.config import TrainerConfig
from async_grpo.trainer.data_path import PerRankDataPath, Rank0DataPath
from async_grpo.trainer.fsdp_setup import DistInfo
from async_grpo.trainer.prompt_feeder import PromptFeeder
from grpo_loss import grpo_loss, step_divisor
from sample_processing_utils import PackedBatch, post_process_batch


@dataclass(slots=True)
class KeptMinibatch:
    """A minibatch kept for the step's later passes (epochs_per_step > 1)."""

    batch: PackedBatch
    """Its packed tensors, old_logprobs set to pi_old."""
    loss_weight: float
    """The batcher's loss weight (0 for a rank's padding minibatch)."""
    step: int
    """The step it belongs to: the weight version its tokens' staleness counts from."""


def _forward_backward(
    model: torch.nn.Module, batch: PackedBatch, loss_weight: float, step: int, config: TrainerConfig, dist: DistInfo
) -> tuple[torch.Tensor, torch.Tensor, float, dict[str, float]]:
    """Score one minibatch, backward its GRPO loss (x world_size x loss_weight: see the module
    docstring); returns the whole minibatch's (logprobs, entropy, loss, loss metrics), detached.
    The weights at step s are version s (pushed versions count steps), so tokens of older
    versions are stale. With context parallelism this rank scores and backwards its share of the
    tokens, and the figures are put back together within its group (collective there)."""
    logprobs, entropy = model.score(batch.inputs)
    group = model.context if dist.context_parallel > 1 else None
    if group is None:
        loss, loss_metrics = grpo_loss(logprobs, batch, config.loss, policy_version=step)
        (loss * dist.world_size * loss_weight).backward()
        return logprobs.detach(), entropy.detach(), float(loss.detach()), loss_metrics
    loss, local_metrics = grpo_loss(logprobs, local_batch(batch, group), config.loss, policy_version=step,
                                    sample_sums=group.sum_over_group)
    (loss * dist.world_size * loss_weight).backward()
    loss_value, loss_metrics = reduce_loss_metrics(loss, local_metrics, logprobs.numel(), group)
    return gather_outputs(logprobs, batch, group), gather_outputs(entropy, batch, group), loss_value, loss_metrics


def train_on_step(
    model: torch.nn.Module, data_path: PerRankDataPath | Rank0DataPath, step: int, config: TrainerConfig, dist: DistInfo,
    acc: StepAccumulator, keep: list[KeptMinibatch] | None = None, feeder: PromptFeeder | None = None,
) -> EndOfStep:
    """Forward/backward every minibatch of this step as it arrives; returns the step's totals.

    With `keep`, each minibatch is appended to it for later passes, with this pass's logprobs as
    its old_logprobs when the samples carry none. A PromptRequest (dynamic sampling) is answered
    through `feeder`. Only the first rank of a context-parallel group counts the minibatches in
    `acc` (every rank of the group trains on them).
    """
    while True:
        wait_start = time.perf_counter()
        received = data_path.next_message(step, config.message_timeout_s)
        acc.add_time("wait_s", time.perf_counter() - wait_start)
        acc.add_data_bytes(ray_bytes=received.ray_bytes, scatter_bytes=received.scatter_bytes)
        message = received.message
        if isinstance(message, EndOfStep):
            return message
        if isinstance(message, PromptRequest):
            if feeder is None:
                raise RuntimeError(f"step {step}: the batcher asks for more prompts but this rank has no feeder")
            feeder.submit_extra(message)
            continue
        assert isinstance(message, Minibatch), f"unexpected batcher message {type(message).__name__}"
        compute_start = time.perf_counter()
        batch = post_process_batch(message.samples, config.model.share_prompts)
        logprobs, entropy, loss, loss_metrics = _forward_backward(model, batch, message.loss_weight, step, config, dist)
        if message.loss_weight > 0 and dist.leads_group:
            acc.add_minibatch(message.samples, batch, entropy, loss, loss_metrics)
        if keep is not None:
            if batch.old_logprobs is None:
                batch = replace(batch, old_logprobs=logprobs)
            keep.append(KeptMinibatch(batch=batch, loss_weight=message.loss_weight, step=step))
        acc.add_time("train_s", time.perf_counter() - compute_start)


def train_again(model: torch.nn.Module, kept: list[KeptMinibatch], config: TrainerConfig, dist: DistInfo,
                acc: StepAccumulator) -> None:
    """Another forward/backward pass over a step's kept minibatches (every rank has as many)."""
    for minibatch in kept:
        compute_start = time.perf_counter()
        logprobs, _, _, loss_metrics = _forward_backward(model, minibatch.batch, minibatch.loss_weight,
                                                         minibatch.step, config, dist)
        if minibatch.loss_weight > 0 and dist.leads_group:
            acc.add_later_epoch(loss_metrics, num_tokens=int(logprobs.numel()))
        acc.add_time("train_s", time.perf_counter() - compute_start)


def take_gradient_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, divisor: float,
                       max_grad_norm: float) -> float:
    """Scale summed gradients by the step's divisor (gradient_divisor), clip, step the optimizer.
    Returns the pre-clip grad norm. The lr schedule is the caller's: it advances once per trainer
    step, however many optimizer steps (epochs) that step takes."""
    for param in model.parameters():
        if param.grad is not None:
            param.grad.div_(divisor)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if isinstance(grad_norm, DTensor):  # FSDP2: the norm of sharded gradients, itself sharded
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)


def update_for_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: LRScheduler,
                    kept: list[KeptMinibatch] | None, divisor: float, config: TrainerConfig, dist: DistInfo,
                    acc: StepAccumulator) -> float:
    """A step's updates once its first pass is done: an optimizer step, then one more pass and
    optimizer step per further epoch over the kept minibatches, then one lr-schedule step (the
    schedule counts trainer steps, not passes). Returns the first optimizer step's grad norm."""
    grad_norm = take_gradient_step(model, optimizer, divisor, config.optim.max_grad_norm)
    for _ in range(1, config.epochs_per_step):
        train_again(model, kept, config, dist, acc)
        take_gradient_step(model, optimizer, divisor, config.optim.max_grad_norm)
    scheduler.step()
    return grad_norm


def gradient_divisor(end: EndOfStep, config: TrainerConfig) -> float:
    """The step's loss divisor under loss.aggregation (grpo_loss.step_divisor)."""
    if config.loss.aggregation == "token_mean" and end.num_samples > 0 and end.num_output_tokens <= 0:
        raise RuntimeError(f"step {end.step}: EndOfStep carries no output-token count for aggregation token_mean")
    max_tokens = config.experience.sampling.max_tokens
    return step_divisor(config.loss.aggregation, end.num_samples, end.num_output_tokens, max_tokens)
