"""The experience batcher's options: `ExperienceConfig`, the ones it shares with the trainer, and
`BatcherConfig`, the batcher's whole config around them.

Each option is declared here once. The trainer embeds ExperienceConfig flat in TrainerConfig
(`run_config.flattened`: its fields are the trainer's top-level flags and file keys,
`--max_lag`, `--max_tokens_per_gpu`, `--sampling.n`, ...) and hands it, whole, to the batcher
it creates (trainer_core.make_batcher_config):

    BatcherConfig(world_size=dist.world_size, experience=trainer_config.experience)

With context parallelism a group of `context_parallel` consecutive trainer ranks is one consumer:
the packer cuts minibatches for the groups, each up to the group's budget (`group_tokens`), and
every rank of a group receives its group's minibatches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from async_grpo.algo.algorithm import AlgorithmConfig, DistillConfig, KLSettings, LogprobRole, check_logprob_sources
from async_grpo.config.sampling import SamplingConfig


@dataclass(kw_only=True, frozen=True)
class ExperienceConfig:
    """What each step trains on, and how it reaches the ranks: how rollouts are sampled and turned
    into advantages, which logprobs they carry, how stale and how late they may be, and the token
    budget of a minibatch. Read by the trainer and by the experience batcher."""

    max_tokens_per_gpu: int = 8192
    """Token budget of one packed minibatch on one rank (prompt + output tokens of all its
    samples). Must be at least data.max_prompt_tokens + sampling.max_tokens, the longest sample a
    run can produce, so that no minibatch exceeds it (see oversized_sample_policy)."""
    prompt_deadline_s: float = 600.0
    """A prompt not finished (generation + logprobs) this long after its rank submitted it is
    cancelled, reported and counted (`batcher/timed_out_prompts`). Queueing behind earlier steps
    counts too, so leave room for max_lag steps of generation."""
    # The lag is step - the version of the rollout's oldest token: a rollout that straddles a push
    # counts from the weights it started on. A step's prompts are submitted as soon as a version >=
    # step - max_lag is published. Staler rollouts come e.g. from a worker that missed a push.
    max_lag: int = 1
    """Most optimizer steps a rollout's weights may lag the step that trains on it (0: synchronous,
    on-policy); generation runs up to max_lag steps ahead of training, and staler rollouts are
    dropped and counted. Must be >= push_every - 1 (see push_every)."""
    logprob_role: LogprobRole = "reference"
    """What the logprob workers compute: reference logprobs (fixed weights, for the KL term; they
    fill ref_logprobs), old-policy logprobs (they receive weight pushes; old_logprobs), or nothing
    (no logprob workers needed, no logprob requests)."""
    reference_pool: bool = False
    """With logprob_role old_policy: also take reference logprobs (for a KL term in the loss or the
    reward) from the reference pool, logprob workers on the frozen starting model started with
    `worker_dispatcher.py --mode reference`, concurrently with the old-policy logprobs."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Rollout sampling (n per prompt, temperature, max_tokens, seed) and advantage options, sent
    with every generate request. An unset sampling.seed is filled in from `seed` (see
    seed_sampling); a seeded config is sent with each step's own seed."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator, or a user's prepare function (algorithm.prepare_batch): how each
    finished group's rewards become advantages."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a teacher pool (`worker_dispatcher.py --mode teacher`): the
    teacher's logprobs are fetched with the others and the distillation term is added to every
    token's advantage."""

    def __post_init__(self) -> None:
        if self.max_tokens_per_gpu < 1:
            raise ValueError(f"ExperienceConfig.max_tokens_per_gpu must be >= 1, got {self.max_tokens_per_gpu}")
        if not self.prompt_deadline_s > 0:
            raise ValueError(f"ExperienceConfig.prompt_deadline_s must be > 0, got {self.prompt_deadline_s}")
        if self.max_lag < 0:
            raise ValueError(f"ExperienceConfig.max_lag must be >= 0, got {self.max_lag}")
        if not isinstance(self.sampling, SamplingConfig):  # SamplingConfig validates its own fields
            raise ValueError(f"ExperienceConfig.sampling must be a SamplingConfig, got {type(self.sampling).__name__}")
        reward = self.sampling.reward
        if reward.may_mask and reward.min_scored_samples > self.sampling.n:
            raise ValueError(f"ExperienceConfig.sampling.reward.min_scored_samples ({reward.min_scored_samples}) "
                             f"exceeds sampling.n ({self.sampling.n}): every group with a masked sample would be dropped")


@dataclass(kw_only=True, frozen=True)
class BatcherConfig:
    """How the batcher requests experience and cuts it into minibatches."""

    world_size: int
    """Number of trainer ranks that receive minibatches."""
    context_parallel: int = 1
    """Trainer ranks per consumer (the trainer's model.context_parallel): a group's first rank
    submits its prompts, and every rank of the group receives the same minibatches."""
    experience: ExperienceConfig
    """The options the batcher shares with the trainer (token budget, prompt deadline, lag bound,
    logprob sources, sampling, advantages, distillation): the trainer's own, handed over whole."""
    reorder_window: int = 16
    """Rollouts the packer holds back to choose a best fit for the open minibatch (0: place each
    rollout on arrival). Raises minibatch fill; see benchmarks/batcher.py for the figures."""
    kl_in_reward: KLSettings | None = None
    """The trainer's loss config when its KL goes into the reward (loss.kl_in_reward): reward -
    beta * KL(sample) before advantages, beta per step from a KLSchedule; needs reference logprobs
    (logprob_role 'reference', or reference_pool). None: the reward has no KL."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"BatcherConfig.world_size must be >= 1, got {self.world_size}")
        if self.context_parallel < 1 or self.world_size % self.context_parallel:
            raise ValueError(f"BatcherConfig.context_parallel={self.context_parallel} must be >= 1 and divide "
                             f"world_size={self.world_size}")
        if not isinstance(self.experience, ExperienceConfig):
            raise ValueError(
                f"BatcherConfig.experience must be an ExperienceConfig, got {type(self.experience).__name__}")
        if self.reorder_window < 0:
            raise ValueError(f"BatcherConfig.reorder_window must be >= 0, got {self.reorder_window}")
        if self.kl_in_reward is not None and not self.kl_in_reward.kl_in_reward:
            raise ValueError("BatcherConfig.kl_in_reward must be a loss config with kl_in_reward true, or None")
        check_logprob_sources("BatcherConfig", self.experience.logprob_role, self.experience.reference_pool,
                              self.kl_in_reward)

    @property
    def groups(self) -> int:
        """Consumers: groups of context_parallel ranks that each take their own minibatches."""
        return self.world_size // self.context_parallel

    @property
    def group_tokens(self) -> int:
        """Token budget of one minibatch: max_tokens_per_gpu on each rank of its group."""
        return self.context_parallel * self.experience.max_tokens_per_gpu
