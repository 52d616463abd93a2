"""push_every and max_lag: the trainer's real loop (start_generation, then run_step per step) with a
stand-in batcher that applies the staleness rule, a stand-in pusher and the real PromptFeeder.

    .venv/bin/python -m pytest tests/trainer/test_trainer_push_schedule.py -x -q

The stand-ins answer in-process (`ray.get` passes values through). A step's rollouts carry the
weight version the stand-in workers served when the step's prompts were submitted, and are
dropped when step - version > max_lag: the rule vllm_experience_batcher applies. Expected pushes
and lags are computed here from the config alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from async_grpo.batching.batcher_config import ExperienceConfig
from async_grpo.data.dataset import DatasetConfig
from async_grpo.trainer.config import TrainerConfig
from async_grpo.trainer.data_path import PerRankDataPath, RayBatcherClient
from async_grpo.trainer.distributed_sampler import InfiniteDistributedSampler
from async_grpo.trainer.fsdp_setup import DistInfo
from async_grpo.trainer.optimizer import OptimConfig, build_optimizer, build_scheduler
from async_grpo.trainer.prompt_feeder import PromptFeeder
from grpo_loss import LossConfig
from sample_processing_utils import Sample
from setup_model import ModelConfig, TokenLogprobModel, load_causal_lm
from trainer_core import StepParts, run_step, start_generation
from vllm_experience_batcher import EndOfStep, Minibatch

# run_step reads no data (the stand-in batcher makes the prompts), but TrainerConfig checks its budget.
UNUSED_DATA = DatasetConfig(path="unused.jsonl")

NUM_STEPS = 7
PROMPTS_PER_RANK = 2
NUM_PROMPTS = 10


class _Remote:
    """`handle.method.remote(*args)` of an actor, answered in-process."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.remote = fn


@dataclass
class _Workers:
    """The weight version the stand-in inference workers serve."""

    version: int = -1


class _StandInBatcher:
    """One rank's batcher: a step's rollouts are sampled at submission on the served version."""

    def __init__(self, workers: _Workers, max_lag: int) -> None:
        self._workers = workers
        self._max_lag = max_lag
        self.version_at_submit: dict[int, int] = {}
        """step -> weight version its rollouts were sampled with."""
        self.submitted_when_trained: dict[int, int] = {}
        """step -> the last step submitted when this step began training."""
        self.dropped_stale = 0
        self._prompts: dict[int, list[Sample]] = {}
        self._fresh: dict[int, list[Sample]] = {}
        self.submit_prompts = _Remote(self._submit_prompts)
        self.next_message = _Remote(self._next_message)
        self.stats = _Remote(lambda step=None: {})

    def _submit_prompts(self, rank: int, step: int, samples: list[Sample], round_index: int = 0) -> None:
        assert step not in self.version_at_submit, f"step {step} submitted twice"
        assert step == len(self.version_at_submit) + min(self.version_at_submit, default=step), "out of order"
        self.version_at_submit[step] = self._workers.version
        self._prompts[step] = samples

    def _rollouts(self, step: int) -> list[Sample]:
        version = self.version_at_submit[step]
        rollouts = [Sample(input_token_ids=list(p.input_token_ids), gt_answer="", prompt_id=p.prompt_id,
                           output_token_ids=[3, 4], sampling_logprobs=[-1.0, -1.0], reward=float(i % 2),
                           advantage=1.0 if i % 2 else -1.0, weight_version=version)
                    for p in self._prompts[step] for i in range(2)]
        fresh = [r for r in rollouts if step - r.weight_version <= self._max_lag]
        self.dropped_stale += len(rollouts) - len(fresh)
        return fresh

    def _next_message(self, rank: int, step: int) -> Minibatch | EndOfStep:
        assert step in self.version_at_submit, f"step {step} trains before its prompts were submitted"
        if step not in self._fresh:  # the step's first message
            self.submitted_when_trained[step] = max(self.version_at_submit)
            self._fresh[step] = self._rollouts(step)
            if self._fresh[step]:
                return Minibatch(step=step, rank=rank, index=0, samples=self._fresh[step], loss_weight=1.0)
        fresh = self._fresh[step]
        return EndOfStep(step=step, num_samples=len(fresh), num_tokens=sum(s.num_tokens for s in fresh),
                         num_minibatches=int(bool(fresh)), num_prompts=PROMPTS_PER_RANK, timed_out_prompts=0,
                         dropped_stale=0, oversized_samples=0, padding_minibatches=0, missing_rollouts=0)


@dataclass
class _StandInPusher:
    workers: _Workers
    versions: list[int] = field(default_factory=list)

    def push(self, model: torch.nn.Module, version: int, initial: bool = False) -> float:
        self.versions.append(version)
        self.workers.version = version
        return 0.0


def _expected_pushes(start: int, push_every: int) -> list[int]:
    return [start] + [v for v in range(start + 1, NUM_STEPS + 1) if v % push_every == 0 or v == NUM_STEPS]


def _run(tiny_model_dir: Path, tmp_path: Path, monkeypatch, push_every: int, max_lag: int, start: int):
    import ray

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    config = TrainerConfig(model=ModelConfig(model_path="unused"), data=UNUSED_DATA, run_dir=str(tmp_path),
                           num_steps=NUM_STEPS, prompts_per_rank=PROMPTS_PER_RANK,
                           experience=ExperienceConfig(max_lag=max_lag, logprob_role="none"),
                           push_every=push_every, loss=LossConfig(kl_coef=0.0))
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    torch.manual_seed(0)
    model = TokenLogprobModel(load_causal_lm(tiny_model_dir, dtype=torch.float32, attn_implementation="eager"))
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
    scheduler = build_scheduler(optimizer, OptimConfig(lr=1e-3))
    workers = _Workers()
    batcher, pusher = _StandInBatcher(workers, max_lag), _StandInPusher(workers)
    prompts = [Sample(input_token_ids=[5, 6, 7], gt_answer="", prompt_id=i) for i in range(NUM_PROMPTS)]
    sampler = InfiniteDistributedSampler(NUM_PROMPTS, 0, 1, seed=0)
    data_path = PerRankDataPath(RayBatcherClient(batcher), prompts, dist)
    feeder = PromptFeeder(sampler, data_path, config, dist, first_step=start)
    start_generation(model, pusher, feeder, start, config)
    parts = StepParts(model=model, optimizer=optimizer, scheduler=scheduler, batcher=batcher, data_path=data_path,
                      pusher=pusher, feeder=feeder)
    records = [run_step(step, parts, config, dist) for step in range(start, NUM_STEPS)]
    return batcher, pusher, records


@pytest.mark.parametrize(
    "push_every, max_lag, start",
    [(1, 0, 0), (1, 1, 0), (2, 1, 0), (2, 2, 0), (3, 2, 0), (3, 3, 2)],
    ids=["sync", "async", "push2-lag1", "push2-lag2", "push3-lag2", "push3-lag3-resumed-at-2"],
)
def test_every_step_trains_on_rollouts_within_max_lag(tiny_model_dir: Path, tmp_path: Path, monkeypatch,
                                                      push_every: int, max_lag: int, start: int) -> None:
    batcher, pusher, records = _run(tiny_model_dir, tmp_path, monkeypatch, push_every, max_lag, start)
    assert pusher.versions == _expected_pushes(start, push_every)
    assert sorted(batcher.version_at_submit) == list(range(start, NUM_STEPS))
    assert batcher.dropped_stale == 0
    for step, record in zip(range(start, NUM_STEPS), records):
        assert record["counts/samples"] == PROMPTS_PER_RANK * 2, (step, record)
        assert record["optim/grad_norm"] > 0, (step, record)
        # Sampled as soon as possible: on the first published version within max_lag of the step.
        sampled_on = min(v for v in pusher.versions if v >= step - max_lag)
        assert batcher.version_at_submit[step] == sampled_on
        assert record["staleness/max"] == step - sampled_on <= max_lag
        # Generation runs as far ahead as the newest version published before the step allows.
        newest = max(v for v in pusher.versions if v <= step)
        assert batcher.submitted_when_trained[step] == min(newest + max_lag, NUM_STEPS - 1)


def test_full_overlap_from_max_lag_equal_push_every(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """With max_lag >= push_every the next step's prompts are always out before a step trains."""
    batcher, _, _ = _run(tiny_model_dir, tmp_path, monkeypatch, push_every=2, max_lag=2, start=0)
    assert all(batcher.submitted_when_trained[s] > s for s in range(NUM_STEPS - 1))


@pytest.mark.parametrize("push_every, max_lag", [(2, 0), (3, 1), (5, 3)])
def test_max_lag_below_push_every_minus_one_is_refused(push_every: int, max_lag: int) -> None:
    with pytest.raises(ValueError, match=f"TrainerConfig.max_lag={max_lag} is below push_every - 1"):
        TrainerConfig(model=ModelConfig(model_path="unused"), data=UNUSED_DATA, push_every=push_every,
                      experience=ExperienceConfig(max_lag=max_lag))
    TrainerConfig(model=ModelConfig(model_path="unused"), data=UNUSED_DATA, push_every=push_every,
                  experience=ExperienceConfig(max_lag=push_every - 1))
