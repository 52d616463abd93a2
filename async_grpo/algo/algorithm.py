"""From scored rollouts to trainable samples: advantages, KL in the reward, and the plug-in hook.

The experience batcher runs one *prepare* function on every finished group of rollouts (the
samples of one (group_id, run_id) pair in a step, reference/old logprobs already filled), or once
on the whole step when the estimator's baseline spans the step (`prepare_scope: step`). It runs
in the batcher, not in the generation worker, because that is the first place that holds what
the algorithms need: the reference logprobs (KL in the reward) arrive after generation, a batch
baseline needs every rank's samples, and dynamic sampling decides there which groups train.
It runs before packing, so the trainer ranks receive samples whose advantages are final.

The built-in estimators go through the same door as a user's function:

    # my_algos.py, named in config as  algorithm.prepare_batch: "my_algos:median_baseline"
    def median_baseline(samples: list[Sample], ctx: AlgorithmContext) -> PreparedSamples:
        median = statistics.median(s.reward for s in samples)
        for s in samples:
            s.advantage = s.reward - median
        return PreparedSamples(samples=samples, metrics={"median": median})

A prepare function receives the samples (rewards, sampling/ref/old logprobs, ids, truncation
flags) and a context (step, the KL coefficient of the step, the config), sets `advantage` on each
(or `token_advantages`, one per output token, for dense per-token credit), and returns them with
metrics: means over the samples it was given, logged per step as `algorithm/<name>`. It may drop
samples (return fewer); the batcher counts them in `counts/prepare_dropped`. See docs/algorithms.md.

Pure Python and numpy: no Ray, no torch.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol, Sequence

import numpy as np

from async_grpo.algo.advantages import ESTIMATORS, STEP_SCOPED_ESTIMATORS, Estimator, estimate
from sample_processing_utils import Sample

PrepareScope = Literal["group", "step"]
KLControllerKind = Literal["fixed", "adaptive"]
PolicyLogprobs = Literal["sampler", "old_policy"]
# Ziegler et al. (2019) clip the relative KL error so one odd step moves beta by a bounded factor.
_ADAPTIVE_ERROR_CLIP = 0.2


@dataclass(kw_only=True, frozen=True)
class AlgorithmConfig:
    """How rewards become advantages (config section `algorithm`)."""

    estimator: Estimator = "grpo"
    """Advantage estimator of the built-in prepare function: grpo ((r - mean) / (std + eps) per
    group), dr_grpo (r - mean), rloo (leave-one-out baseline), reinforce_pp (whitened over the
    whole step; holds the step's samples until its generation is done). See advantages.py."""
    advantage_eps: float = 1e-4
    """Added to the std before dividing (grpo, reinforce_pp), so equal rewards give advantage 0."""
    prepare_batch: str | None = None
    """A user's prepare function as "module:function" (the module importable from the trainer's
    working directory, on every node running the batcher); None uses the built-in estimators."""
    prepare_scope: PrepareScope | None = None
    """What one call of the prepare function sees: 'group' (one (group_id, run_id) group, called
    as soon as the group is finished, so packing streams) or 'step' (every sample of the step at
    once, after its generation is done). None: 'step' for reinforce_pp, else 'group'."""

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"AlgorithmConfig.estimator must be one of {list(ESTIMATORS)}, got {self.estimator!r}")
        if not (self.advantage_eps >= 0 and math.isfinite(self.advantage_eps)):
            raise ValueError(f"AlgorithmConfig.advantage_eps must be a finite number >= 0, got {self.advantage_eps}")
        if self.prepare_batch is not None and not _is_hook_spec(self.prepare_batch):
            raise ValueError(
                f"AlgorithmConfig.prepare_batch must look like 'module:function', got {self.prepare_batch!r}"
            )
        if self.prepare_scope is not None and self.prepare_scope not in ("group", "step"):
            raise ValueError(f"AlgorithmConfig.prepare_scope must be group, step or None, got {self.prepare_scope!r}")
        if self.estimator in STEP_SCOPED_ESTIMATORS and self.prepare_batch is None and self.prepare_scope == "group":
            raise ValueError(f"AlgorithmConfig.estimator {self.estimator} needs the whole step: prepare_scope step")

    @property
    def scope(self) -> PrepareScope:
        """The resolved prepare_scope."""
        if self.prepare_scope is not None:
            return self.prepare_scope
        return "step" if self.prepare_batch is None and self.estimator in STEP_SCOPED_ESTIMATORS else "group"


LogprobRole = Literal["reference", "old_policy", "none"]
"""What the logprob workers compute: reference logprobs (a frozen model; for a KL term),
old-policy logprobs (the weights that sampled the rollout; for PPO ratios and IS corrections), or
nothing (no logprob requests)."""


class KLSettings(Protocol):
    """The KL(policy || reference) settings the batcher reads when the KL goes into the reward.
    Declared, documented and validated once, in grpo_loss.LossConfig (its kl_* fields); this
    protocol only names the ones used here, so this module needs no torch."""

    kl_coef: float
    kl_in_reward: bool
    kl_policy_logprobs: PolicyLogprobs
    kl_controller: KLControllerKind
    target_kl: float
    kl_horizon: int


def check_logprob_sources(owner: str, logprob_role: LogprobRole, reference_pool: bool,
                          kl: KLSettings | None) -> None:
    """Every logprob the loss and the reward need has a service that computes it (the trainer's
    config and the batcher's both ask, before anything starts). kl None: no KL term to feed."""
    if logprob_role not in ("reference", "old_policy", "none"):
        raise ValueError(f"{owner}.logprob_role must be reference, old_policy or none, got {logprob_role!r}")
    if reference_pool and logprob_role != "old_policy":
        raise ValueError(f"{owner}.reference_pool goes with logprob_role old_policy (under 'reference' the logprob "
                         f"workers compute reference logprobs themselves), got {logprob_role}")
    if kl is None:
        return
    if kl.kl_coef > 0 and logprob_role != "reference" and not reference_pool:
        where = "the reward (loss.kl_in_reward)" if kl.kl_in_reward else "the loss"
        raise ValueError(f"{owner}: loss.kl_coef > 0 puts a KL term in {where}, which needs reference logprobs: "
                         f"logprob_role reference, or old_policy with reference_pool true; got logprob_role "
                         f"{logprob_role}")
    if kl.kl_in_reward and kl.kl_policy_logprobs == "old_policy" and logprob_role != "old_policy":
        raise ValueError(f"{owner}: loss.kl_policy_logprobs old_policy needs logprob_role old_policy (with "
                         f"reference_pool true), got {logprob_role}")


@dataclass(kw_only=True, frozen=True)
class DistillConfig:
    """On-policy distillation from a teacher pool (config section `distill`): the student's own
    samples are scored by the teacher, and each token's advantage gains
    coef x (log p_teacher(t) - log p_student(t)), the negated per-token reverse KL (the student's
    logprobs are the sampler's). Teacher workers: `worker_dispatcher.py --mode teacher
    --model_path <teacher>`; the teacher must share the student's tokenizer (checked at start)."""

    teacher: bool = False
    """Ask the teacher pool for the teacher's logprob of every sampled token and distill."""
    coef: float = 1.0
    """Weight of the per-token distillation advantage."""
    use_reward: bool = True
    """Add the estimator's advantage from the reward (GRPO + distillation); false distils alone:
    the reward only shows in the metrics."""
    # group_mean is a baseline as GRPO's group mean is for the reward: on the student's samples the
    # sampled-token term is mostly negative (a wrong token costs a lot, a right one gains little),
    # and the baseline turns the better-than-the-group samples' tokens positive.
    baseline: Literal["none", "group_mean"] = "none"
    """none: each token's term is coef x (log p_teacher - log p_student) as is. group_mean: minus
    coef x the mean token-mean reverse KL of the sample's group ((group_id, run_id));
    docs/distillation.md."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.coef) and self.coef > 0):
            raise ValueError(f"DistillConfig.coef must be a finite number > 0, got {self.coef}")
        if self.baseline not in ("none", "group_mean"):
            raise ValueError(f"DistillConfig.baseline must be 'none' or 'group_mean', got {self.baseline!r}")


class KLController:
    """The coefficient beta of the KL in the reward: fixed, or adaptive (Ziegler et al., 2019):

        e = clip(KL / target_kl - 1, -0.2, 0.2);   beta <- beta * (1 + e * n / horizon)

    where KL is the step's mean per-sample KL and n its number of samples."""

    def __init__(self, config: KLSettings) -> None:
        self.config = config
        self.beta = config.kl_coef

    def update(self, measured_kl: float, num_samples: int) -> None:
        """Move beta after a step that measured `measured_kl` over `num_samples` samples."""
        if self.config.kl_controller == "fixed" or num_samples <= 0:
            return
        error = float(np.clip(measured_kl / self.config.target_kl - 1.0, -_ADAPTIVE_ERROR_CLIP, _ADAPTIVE_ERROR_CLIP))
        self.beta *= 1.0 + error * num_samples / self.config.kl_horizon

    def state_dict(self) -> dict[str, float]:
        return {"beta": self.beta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.beta = float(state["beta"])


class KLSchedule:
    """Which beta each step uses, reproducibly under asynchronous generation.

    Step s uses beta after the updates of steps 0 .. s - 1 - max_lag, applied in step order: those
    are the steps certainly finished when step s's prompts can be submitted (the trainer submits
    step s only after pushing weights trained on step s - 1 - max_lag). With max_lag 0 that is
    the usual "beta of the previous step". A rerun, or a resumed run given `state_for(k)`, gives
    every step the same beta.
    """

    _HISTORY = 256  # steps of beta history kept (state_for looks back max_lag + 1 steps)

    def __init__(self, config: KLSettings, max_lag: int) -> None:
        self._controller = KLController(config)
        self._max_lag = max_lag
        self._applied_through = -1
        """Last step whose measured KL has been applied to the controller."""
        self._measured: dict[int, tuple[float, int]] = {}
        """(mean KL, samples) of each finished step (recent ones)."""
        self._beta_after: dict[int, float] = {-1: self._controller.beta}
        """beta after the updates through each step (-1: the initial beta); recent steps only."""

    def record(self, step: int, mean_kl: float, num_samples: int) -> None:
        """The measured KL of a finished step."""
        self._measured[step] = (mean_kl, num_samples)

    def beta_for(self, step: int) -> float:
        """beta of `step` (see the class docstring); applies the pending updates it needs."""
        through = max(step - 1 - self._max_lag, -1)
        while self._applied_through < through:
            t = self._applied_through + 1
            if t not in self._measured:
                raise RuntimeError(f"KL schedule: step {step} needs the measured KL of step {t}, which has not finished")
            self._controller.update(*self._measured[t])
            self._applied_through = t
            self._beta_after[t] = self._controller.beta
        for old in [t for t in self._beta_after if t < through - self._HISTORY]:
            del self._beta_after[old]
        for old in [t for t in self._measured if t < through - self._HISTORY]:
            del self._measured[old]
        return self._beta_after[through]

    def state_for(self, step: int) -> dict[str, Any]:
        """What a run resuming at `step` needs to give steps >= `step` the betas they got here:
        beta after the updates through step - 1 - max_lag, and the measured KLs after that."""
        through = max(step - 1 - self._max_lag, -1)
        if through > self._applied_through:
            self.beta_for(step)
        measured = {str(t): list(self._measured[t]) for t in range(through + 1, step) if t in self._measured}
        return {"beta": self._beta_after[through], "applied_through": through, "measured": measured}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._controller.load_state_dict(state)
        self._applied_through = int(state["applied_through"])
        self._beta_after = {self._applied_through: self._controller.beta}
        self._measured = {int(t): (float(v[0]), int(v[1])) for t, v in state.get("measured", {}).items()}


@dataclass(slots=True)
class AlgorithmContext:
    """What a prepare function knows besides the samples."""

    step: int
    """The training step the samples belong to."""
    config: AlgorithmConfig
    """The run's algorithm section (estimator, eps, scope)."""
    kl_beta: float | None = None
    """beta of the KL in the reward for this step; None when the KL is not in the reward."""
    kl_policy_logprobs: PolicyLogprobs = "sampler"
    """Which logprobs stand for the policy in that KL (LossConfig.kl_policy_logprobs)."""
    distill: DistillConfig | None = None
    """Distillation settings when the samples carry teacher logprobs; None: no distillation."""


@dataclass(slots=True)
class PreparedSamples:
    """A prepare function's answer."""

    samples: list[Sample]
    """The samples to train on, `advantage` (or `token_advantages`) set."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Means over the samples given; logged per step as algorithm/<name> (sample-weighted)."""


PrepareFn = Callable[[list[Sample], AlgorithmContext], PreparedSamples]


def sequence_kl(sample: Sample, policy: PolicyLogprobs = "sampler") -> float:
    """KL(policy || reference) of one rollout: sum over its response tokens of
    log pi(t) - log pi_ref(t), pi's logprobs taken from the sampler (its sampled-token logprobs)
    or from the old-policy logprob workers."""
    policy_values = sample.sampling_logprobs if policy == "sampler" else sample.old_logprobs
    if not sample.ref_logprobs or not policy_values:
        missing = "reference" if not sample.ref_logprobs else f"{policy} policy"
        raise ValueError(f"sample prompt_id={sample.prompt_id}: the KL in the reward needs {missing} logprobs")
    if len(policy_values) != len(sample.ref_logprobs):
        raise ValueError(
            f"sample prompt_id={sample.prompt_id}: {len(policy_values)} {policy} logprobs for "
            f"{len(sample.ref_logprobs)} reference logprobs"
        )
    return float(np.sum(np.asarray(policy_values, np.float64) - np.asarray(sample.ref_logprobs, np.float64)))


def builtin_prepare(samples: list[Sample], ctx: AlgorithmContext) -> PreparedSamples:
    """The built-in estimators (AlgorithmConfig.estimator), with the KL in the reward when
    ctx.kl_beta is set (advantages of reward - beta * KL(sample)), then the distillation term per
    token when ctx.distill is set (see `distill_token_advantages`)."""
    rewards = [s.reward for s in samples]
    if ctx.kl_beta is not None:
        rewards = [r - ctx.kl_beta * sequence_kl(s, ctx.kl_policy_logprobs) for r, s in zip(rewards, samples)]
    for sample, advantage in zip(samples, estimate(ctx.config.estimator, rewards, ctx.config.advantage_eps)):
        sample.advantage = float(advantage)
        sample.token_advantages = None
    metrics: dict[str, float] = {}
    if ctx.distill is not None:
        metrics["distill/reverse_kl"] = distill_token_advantages(samples, ctx.distill)
    return PreparedSamples(samples=samples, metrics=metrics)


def distill_token_advantages(samples: list[Sample], config: DistillConfig) -> float:
    """Set each sample's token_advantages to (its advantage if config.use_reward else 0)
    + coef x (log p_teacher(t) - log p_student(t) + b), where b is 0, or with config.baseline
    group_mean the mean token-mean reverse KL of the sample's group; returns the mean over samples
    of each sample's token-mean reverse KL, log p_student - log p_teacher (its sampled-token
    estimate)."""
    gaps = []
    for s in samples:
        if not s.teacher_logprobs or len(s.teacher_logprobs) != len(s.sampling_logprobs):
            raise ValueError(f"sample prompt_id={s.prompt_id}: distillation needs one teacher logprob per output "
                             f"token, got {len(s.teacher_logprobs or [])} for {len(s.sampling_logprobs)}")
        gaps.append(np.asarray(s.sampling_logprobs, np.float64) - np.asarray(s.teacher_logprobs, np.float64))
    per_sample_kl = [float(gap.mean()) for gap in gaps]
    baselines = [0.0] * len(samples)
    if config.baseline == "group_mean":
        groups: dict[tuple[int, int], list[int]] = {}
        for i, s in enumerate(samples):
            groups.setdefault(s.group_key, []).append(i)
        for members in groups.values():
            mean = float(np.mean([per_sample_kl[i] for i in members]))
            for i in members:
                baselines[i] = mean
    for s, gap, b in zip(samples, gaps, baselines):
        base = s.advantage if config.use_reward else 0.0
        s.token_advantages = (base - config.coef * (gap - b)).tolist()
        if not config.use_reward:
            s.advantage = 0.0
    return float(np.mean(per_sample_kl)) if per_sample_kl else 0.0


def _is_hook_spec(spec: str) -> bool:
    module, _, name = spec.partition(":")
    return bool(module) and name.isidentifier() and all(part.isidentifier() for part in module.split("."))


def load_prepare_fn(config: AlgorithmConfig) -> PrepareFn:
    """The run's prepare function: the user's `prepare_batch`, imported now (an import error or
    a missing name is reported at start-up, naming the spec), or `builtin_prepare`."""
    if config.prepare_batch is None:
        return builtin_prepare
    module_name, _, name = config.prepare_batch.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"algorithm.prepare_batch {config.prepare_batch!r}: cannot import {module_name}: {exc}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"algorithm.prepare_batch {config.prepare_batch!r}: {module_name} has no function {name}")
    return fn


def check_prepared(prepared: Any, given: Sequence[Sample], spec: str) -> PreparedSamples:
    """Validate a prepare function's answer; errors name the function and the sample."""
    if not isinstance(prepared, PreparedSamples):
        raise TypeError(f"{spec} returned {type(prepared).__name__}, not PreparedSamples")
    given_ids = {id(s) for s in given}
    for sample in prepared.samples:
        if id(sample) not in given_ids:
            raise ValueError(f"{spec} returned a sample (prompt_id={sample.prompt_id}) it was not given")
        if not math.isfinite(sample.advantage):
            raise ValueError(f"{spec}: sample prompt_id={sample.prompt_id} has advantage {sample.advantage}")
        if sample.token_advantages is not None:
            if len(sample.token_advantages) != sample.num_sampled_tokens:
                raise ValueError(
                    f"{spec}: sample prompt_id={sample.prompt_id} has {len(sample.token_advantages)} token_advantages "
                    f"for {sample.num_sampled_tokens} output tokens the engine sampled"
                )
            if not all(math.isfinite(a) for a in sample.token_advantages):
                raise ValueError(f"{spec}: sample prompt_id={sample.prompt_id} has a non-finite token advantage")
    for name, value in prepared.metrics.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"{spec}: metric {name!r} is {type(value).__name__}, not a number")
    return prepared
