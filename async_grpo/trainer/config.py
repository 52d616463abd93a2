"""TrainerConfig: everything a run needs, one typed section per subsystem.

trainer_core.py's entry point parses it once (`load_trainer_config`: defaults < --config FILE <
flags) and saves the resolved config as run_dir/config.yaml; local_cluster.py loads it from the
flags after its `--` to check the run's inputs before any worker starts. docs/config.md lists
every field (scripts/config_docs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from async_grpo.algo.algorithm import check_logprob_sources
from async_grpo.batching.batcher_config import ExperienceConfig
from async_grpo.config.run_config import flattened
from async_grpo.config.worker_options import RayConnectionConfig
from async_grpo.data.dataset import DatasetConfig
from async_grpo.config.sampling import SEED_BOUND
from async_grpo.telemetry.collapse import CollapseConfig
from async_grpo.telemetry.console import LogLevel
from async_grpo.telemetry.metrics import MetricsConfig
from async_grpo.trainer.evaluation import EvalConfig
from async_grpo.trainer.optimizer import OptimConfig
from async_grpo.weights.trainer_cuda_transfer import TrainerTransferConfig
from grpo_loss import LossConfig
from setup_model import ModelConfig

# The largest context-parallel degree a budget refusal suggests: past the attention heads of the
# models this trainer serves (Qwen2.5 has 14 to 40 query heads), a larger group splits nothing more.
MAX_SUGGESTED_CONTEXT_PARALLEL = 16


@dataclass(kw_only=True, frozen=True)
class TrainerConfig:
    """Everything a run needs; saved as run_dir/config.yaml."""

    run_dir: str = "runs/grpo"
    """Where config, metrics, TensorBoard logs and checkpoints go."""
    model: ModelConfig
    """Policy model (path, chunk size, gradient checkpointing)."""
    data: DatasetConfig
    """Prompt dataset."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW, learning-rate schedule and gradient clipping."""
    loss: LossConfig = field(default_factory=LossConfig)
    """GRPO loss options (KL in the loss or the reward, clipping, aggregation, ratio level,
    importance sampling)."""
    experience: ExperienceConfig = flattened(ExperienceConfig())
    """What each step trains on: sampling, advantages, distillation, logprob sources, the lag
    bound, the prompt deadline and the minibatch token budget. Its fields are top-level flags
    (`--max_lag`, `--sampling.n`, ...; batcher_config.ExperienceConfig); the experience batcher
    receives the section whole."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Periodic greedy accuracy (and pass@k) on held-out prompts through the generation workers
    (`eval.data.path`, `eval.every`; off by default). Rank 0 evaluates the weights just pushed."""
    num_steps: int = 100
    """Optimizer steps to train for (a resumed run continues up to this total)."""
    prompts_per_rank: int = 8
    """Prompts each rank submits per step (the step's batch is world_size x this x n samples); with
    model.context_parallel, each group of ranks (world_size / context_parallel groups)."""
    oversized_sample_policy: Literal["refuse", "train_alone"] = "refuse"
    """refuse: a config whose longest sample (data.max_prompt_tokens + sampling.max_tokens) exceeds
    max_tokens_per_gpu is an error at load time. train_alone: accept it; a sample over the budget
    trains alone in its own minibatch (counts/oversized_samples)."""
    # Passes after the first take the first pass's logprobs as pi_old (unless the samples carry
    # old-policy logprobs), so the clipped ratio bounds how far one batch moves the policy.
    epochs_per_step: int = 1
    """Passes over each step's samples, each ending in an optimizer step (PPO epochs; TRL's
    num_iterations). Weights are pushed, and the lr schedule advances, once per step."""
    weight_push_mode: Literal["gather", "sharded", "lora_files"] = "gather"
    """gather: rank 0 publishes the full state; sharded: every rank its own FSDP shards (with
    model.lora, both of the adapter); lora_files (model.lora only): rank 0 writes the adapter to
    <run_dir>/weights/step_N/. With LoRA, workers must read <run_dir>/weights/ in every mode."""
    transfer: TrainerTransferConfig = field(default_factory=TrainerTransferConfig)
    """How full weights reach the generation engines: 'object_store', or on CUDA one of vLLM's
    engines ('nccl' with weight_push_mode gather, 'nccl_m2n' with sharded, 'ipc' with gather on the
    engines' GPUs); the workers read the same option (worker_options.EngineTransferConfig)."""
    # 'auto' sends workers what the trainer computed with; in bf16 a push moves half fp32's bytes.
    weight_push_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of the weights pushed to the inference workers (cast on each rank; checkpoints stay
    fp32). auto: bfloat16 when the trainer computes in bf16 (CUDA with model.mixed_precision),
    else float32."""
    # Only versions that are multiples of push_every are published (plus the start). The staleness
    # bound stays max_lag steps, counted against the published versions: step s's prompts wait for
    # a published version >= s - max_lag, so step push_every - 1 can only use version 0. With
    # max_lag == push_every - 1 the prompts of the step right after a push are generated only after
    # that push, while nothing trains.
    push_every: int = 1
    """Publish weights to the inference workers after every this many steps and after the last.
    Needs max_lag >= push_every - 1; generation overlaps training at every step from max_lag >=
    push_every on."""
    # rank0: rank 0 reads every rank's minibatches and acknowledges them, so the other ranks never
    # receive data over Ray (benchmarks/RESULTS.md, "Data path: `per_rank` vs `rank0`").
    data_path: Literal["per_rank", "rank0"] = "per_rank"
    """How ranks exchange prompts and minibatches with the batcher (data_path.py). per_rank: each
    rank over Ray. rank0: only rank 0 talks to the batcher and scatters each rank its share over
    the process group (gloo/NCCL). Both give every rank the same minibatches."""
    checkpoint_every: int = 0
    """Checkpoint every N steps (0: only at the end of the run, see checkpoint_at_end)."""
    checkpoint_at_end: bool = True
    """Checkpoint after the last step. A checkpoint gathers the full optimizer state on rank 0
    (for AdamW, twice the fp32 weights): turn it off for throwaway runs where host memory is short."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept on disk (older ones are deleted)."""
    # One save at a time: the loop also waits for a previous save still writing. Still atomic (a
    # tmp directory renamed into place); the trainer waits for the last save before it exits.
    # `timing/checkpoint_s` is the time the loop was blocked by checkpointing, in either mode
    # (benchmarks/RESULTS.md, "Background checkpoints: `checkpoint_async` false vs true").
    checkpoint_async: bool = False
    """Write checkpoints on a background thread of rank 0 while training goes on; the loop blocks
    only for the snapshot into CPU copies, which rank 0 holds until written (for AdamW about 3x
    the fp32 weights of host memory)."""
    resume: bool = False
    """Continue from the latest complete checkpoint in run_dir."""
    seed: int = 0
    """Seed of the data order, the torch RNG and (see seed_sampling) rollout sampling."""
    # Each step still gets its own seed (vllm_experience_batcher.step_sampling). vLLM draws a
    # seeded request's noise from its own generator, one request at a time in every decoding step
    # (a loop vLLM marks as slow), which can cost throughput on large batches.
    seed_sampling: bool = True
    """Seed rollout sampling with `seed` when sampling.seed is unset, so a rerun or a resumed run
    samples the same rollouts (within float-level kernel differences). False: unseeded, which can
    be faster on large batches; sampling.seed must then stay unset."""
    message_timeout_s: float = 1800.0
    """Longest wait for the next minibatch before the trainer gives up with an error."""
    dist_timeout_s: float = 1800.0
    """torch.distributed collective timeout: a dead rank stops the others with an error. The
    rank-0 data path waits 0.9 of it, so a dead or hung rank 0 is reported as Rank0DataPathError
    before NCCL's watchdog aborts the process."""
    connection: RayConnectionConfig = flattened(RayConnectionConfig())
    """Which Ray cluster to join (started with `ray start`) and how long to try
    (worker_options.RayConnectionConfig)."""
    tensorboard: bool = True
    """Also write metrics to run_dir/tensorboard (false: off, whatever metrics.report_to says)."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Where rank 0 reports metrics besides metrics.jsonl: TensorBoard, W&B, MLflow, trackio (docs/trackers.md)."""
    collapse: CollapseConfig = field(default_factory=CollapseConfig)
    """When rank 0 warns that the policy may be collapsing: first-token entropy stuck low while the
    reward is below its best, or the 10-step mean reward fallen below its best (docs/console.md)."""
    progress_bar: bool = True
    """Rank 0's progress on the console: a bar (reward, its 10-step mean, the last evaluation's
    accuracy, step time) on a terminal, a line every tenth of the run elsewhere (docs/console.md)."""
    log_level: LogLevel = "warning"
    """What rank 0's console (and local_cluster.py's) shows besides progress, evaluations and the
    summary. warning: warnings and errors; INFO lines go to run_dir/run.log only. info: INFO and
    Ray's start-up lines on the console too; debug: DEBUG lines too. Other ranks: warnings."""

    def __post_init__(self) -> None:
        # The experience section has checked its own fields (max_tokens_per_gpu >= 1, max_lag >= 0, ...).
        for name in ("num_steps", "prompts_per_rank", "push_every", "keep_checkpoints", "epochs_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainerConfig.{name} must be >= 1, got {getattr(self, name)}")
        max_lag = self.experience.max_lag
        if max_lag < self.push_every - 1:
            raise ValueError(
                f"TrainerConfig.max_lag={max_lag} is below push_every - 1 = {self.push_every - 1}: with "
                f"push_every={self.push_every} step {self.push_every - 1} can only sample from weights published "
                f"{self.push_every - 1} steps earlier, and all its rollouts would be dropped as stale; raise "
                f"max_lag to at least {self.push_every - 1} (to {self.push_every} for full overlap) or lower push_every"
            )
        self._check_sample_budget()
        self._check_context_parallel()
        if self.weight_push_mode == "lora_files" and not self.model.lora.enabled:
            raise ValueError("TrainerConfig.weight_push_mode lora_files pushes LoRA adapters: set model.lora.r > 0, "
                             "or use gather/sharded for full weights")
        if self.checkpoint_every < 0:
            raise ValueError(f"TrainerConfig.checkpoint_every must be >= 0, got {self.checkpoint_every}")
        self._check_logprob_sources()
        if self.optim.total_steps is None:  # the schedule ends with the run unless set
            object.__setattr__(self, "optim", replace(self.optim, total_steps=self.num_steps))
        if self.loss.decoupled is None:
            # Derived: stale tokens exist only with max_lag >= 1; config.yaml records the choice.
            object.__setattr__(self, "loss", replace(self.loss, decoupled=max_lag >= 1))
        sampling = self.experience.sampling
        if not self.seed_sampling and sampling.seed is not None:
            raise ValueError(
                f"TrainerConfig.seed_sampling is false but sampling.seed is {sampling.seed}: unset one of them"
            )
        if self.seed_sampling and sampling.seed is None:
            if not 0 <= self.seed < SEED_BOUND:
                raise ValueError(f"TrainerConfig.seed seeds sampling and must be in [0, 2**31), got {self.seed}")
            # The resolved seed is what config.yaml records and what the batcher sends.
            seeded = replace(sampling, seed=self.seed)
            object.__setattr__(self, "experience", replace(self.experience, sampling=seeded))

    def _check_logprob_sources(self) -> None:
        """Every logprob the loss and the reward need has a service that computes it."""
        check_logprob_sources("TrainerConfig", self.experience.logprob_role, self.experience.reference_pool, self.loss)

    @property
    def longest_sample(self) -> int:
        """The longest sample the run can produce (prompt + output tokens): a multi-turn
        rollout's whole stream, observations included, else the prompt budget plus max_tokens."""
        sampling = self.experience.sampling
        environment = sampling.environment if sampling.environment.enabled else sampling.verifiers
        if environment.enabled:
            return environment.max_total_tokens
        return self.data.max_prompt_tokens + sampling.max_tokens

    def _check_context_parallel(self) -> None:
        """Refuse, in one line, what has not run with context parallelism yet."""
        cp = self.model.context_parallel
        if cp == 1:
            return
        unsupported = {"data_path=rank0": self.data_path == "rank0", "resume": self.resume,
                       "model.lora": self.model.lora.enabled,
                       "sampling.drop_zero_variance_groups": self.experience.sampling.drop_zero_variance_groups}
        for name, chosen in unsupported.items():
            if chosen:
                raise ValueError(f"TrainerConfig.{name} does not run with model.context_parallel={cp} yet "
                                 f"(docs/training.md, 'Context parallelism'): turn one off")

    def _check_sample_budget(self) -> None:
        """Refuse (unless oversized_sample_policy allows it) a budget one sample could exceed: a
        minibatch's, max_tokens_per_gpu on each rank of a context-parallel group."""
        sampling, per_gpu, cp = self.experience.sampling, self.experience.max_tokens_per_gpu, self.model.context_parallel
        budget = per_gpu * cp
        what = (f"max_tokens_per_gpu={budget}" if cp == 1
                else f"max_tokens_per_gpu x model.context_parallel = {per_gpu} x {cp} = {budget}")
        longest = self.longest_sample
        environment = sampling.environment if sampling.environment.enabled else sampling.verifiers
        if environment.enabled:
            if self.oversized_sample_policy == "refuse" and longest > budget:
                raise ValueError(
                    f"TrainerConfig.{what} is below "
                    f"sampling.{'environment' if environment is sampling.environment else 'verifiers'}"
                    f".max_total_tokens={longest}: one multi-turn rollout could exceed the "
                    f"minibatch budget; raise max_tokens_per_gpu or lower max_total_tokens")
        if self.oversized_sample_policy == "refuse" and longest > budget:
            degree = -(-longest // per_gpu)
            # A degree past any model's attention heads splits nothing more: suggest it only when usable.
            context = (f" or model.context_parallel to at least {degree} (a divisor of the attention heads: "
                       f"docs/training.md, 'Context parallelism')" if degree <= MAX_SUGGESTED_CONTEXT_PARALLEL else "")
            raise ValueError(
                f"TrainerConfig.{what} is below data.max_prompt_tokens + "
                f"sampling.max_tokens = {self.data.max_prompt_tokens} + {sampling.max_tokens} = {longest}: "
                f"one sample could exceed the minibatch budget; raise max_tokens_per_gpu to at least {-(-longest // cp)}"
                f"{context}, lower data.max_prompt_tokens or sampling.max_tokens, "
                f"or set oversized_sample_policy: train_alone"
            )
