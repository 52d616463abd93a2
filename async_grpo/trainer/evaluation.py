"""Evaluation: greedy accuracy and pass@k on a held-out prompt set, through the generation workers.

Every `eval.every` optimizer steps (and after the last one) the trainer's rank 0 sends each
held-out prompt to the generation registry twice, concurrently with all the others: once greedy
(temperature 0, n 1) and, with `eval.pass_k` > 0, once sampled with `num_samples` completions.
The workers score completions exactly as in training (math-verify, the training sampling's
`truncated_reward`), so `eval/accuracy` is the share of greedy answers with reward >= 1 and
`eval/pass@k` is the unbiased estimator of Chen et al. (2021) over the sampled completions.

    evaluator = Evaluator.load(config.eval, config.data, config.experience.sampling, tokenizer)
    client = RayRegistryClient(ray.get_actor(registry_name(GENERATION), namespace=RAY_NAMESPACE))
    metrics = evaluator.run(client).metrics()   # {"eval/accuracy": ..., "eval/pass@4": ..., ...}

The maths (`pass_at_k`, `evaluation_metrics`) is pure; `Evaluator` talks to any client with the
batcher's `submit(method, *args, cost)` protocol and knows nothing of Ray.

Tests: `.venv/bin/python -m pytest tests/trainer/test_evaluation.py -q` (one test starts a real engine).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Awaitable, Iterable, Literal, Sequence, TypeVar, get_args

from async_grpo.batching.rollout_fetcher import RequestClient
from async_grpo.config.judge_config import JudgeConfig
from async_grpo.data.dataset import DATA_FORMATS, DataFormat, DatasetConfig, PromptTokenizer, load_prompts
from async_grpo.rewards.shaping import counts_as_solved
from async_grpo.config.sampling import SamplingConfig
from sample_processing_utils import Sample

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The verifier pays 1.0 for a matching answer and 0.0 otherwise (math_verifier.RewardResult); a
# truncated completion gets SamplingConfig.truncated_reward, which may be anything. Only a full
# reward counts as solved, as in the trainer's `reward/accuracy`.
CORRECT_REWARD = 1.0
GENERATE_METHOD = "generate"
# Room for a few hundred prompts of math with long answers on a busy pool, and below the
# trainer's default dist_timeout_s (1800 s), which the other ranks wait at while rank 0 evaluates.
DEFAULT_TIMEOUT_S = 600.0
EvalReward = Literal["training", "math_verify"]
EVAL_REWARDS: tuple[str, ...] = get_args(EvalReward)
METRIC_PREFIX = "eval/"


class EvaluationError(RuntimeError):
    """An evaluation could not finish: a request failed, a worker answered wrongly, or it timed out."""


@dataclass(kw_only=True, frozen=True)
class EvalDataConfig:
    """The held-out prompt file; read and validated like the training data (dataset.load_prompts)."""

    path: str = ""
    """JSONL prompt file in the training data's format; "" means no evaluation set."""
    max_prompt_tokens: int | None = None
    """Longest prompt accepted, in tokens; None takes the training data's max_prompt_tokens."""
    format: DataFormat | None = None
    """The evaluation file's own record layout (dataset.DatasetConfig.format, e.g. "verl" or
    "gsm8k"), with prompt_field / answer_field below; None reads it like the training data."""
    prompt_field: str | None = None
    """With `format`: the field holding the prompt (DatasetConfig.prompt_field)."""
    answer_field: str | None = None
    """With `format`: the field holding the gold answer (DatasetConfig.answer_field)."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, str):
            raise ValueError(f"EvalDataConfig.path must be a path string, got {self.path!r}")
        if self.format is not None and self.format not in DATA_FORMATS:
            raise ValueError(f"EvalDataConfig.format must be one of {list(DATA_FORMATS)} or None, got {self.format!r}")
        if self.format is None and (self.prompt_field or self.answer_field):
            raise ValueError("EvalDataConfig.prompt_field/answer_field need EvalDataConfig.format")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"EvalDataConfig.max_prompt_tokens must be >= 1 or None, got {self.max_prompt_tokens}")


@dataclass(kw_only=True, frozen=True)
class EvalConfig:
    """Periodic evaluation on held-out prompts (off by default)."""

    data: EvalDataConfig = field(default_factory=EvalDataConfig)
    """Held-out prompts (`eval.data.path`)."""
    every: int = 0
    """Evaluate after every N optimizer steps and after the last step; 0 turns evaluation off."""
    pass_k: int = 0
    """k of pass@k, computed from `num_samples` sampled completions per prompt; 0 runs greedy only."""
    num_samples: int | None = None
    """Sampled completions per prompt for pass@k (n >= k; a larger n lowers the estimator's
    variance); None means n = pass_k. Only with pass_k > 0."""
    temperature: float = 1.0
    """Sampling temperature of the pass@k completions (> 0); greedy answers use 0."""
    top_p: float = 1.0
    """Nucleus-sampling mass of the pass@k completions, in (0, 1]."""
    seed: int = 0
    """Base seed of the pass@k completions. Prompt i's request uses seed + i * n (see
    SamplingConfig.seed), the same at every evaluation, so two evaluations differ only by the
    weights (up to float-level noise of the kernels)."""
    max_tokens: int | None = None
    """Most tokens of one evaluation completion; None takes the training sampling's max_tokens."""
    max_prompts: int | None = None
    """Evaluate only the file's first N prompts; None evaluates them all."""
    reward: EvalReward = "training"
    """What scores evaluation answers: training (the training reward) or math_verify (math-verify
    alone, e.g. to measure correctness apart from a model judge the run trains on)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Longest one evaluation may take before it fails. Keep it below the trainer's
    dist_timeout_s: the other ranks wait in a collective while rank 0 evaluates."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"EvalConfig.every must be >= 0 (0 = off), got {self.every}")
        if self.every > 0 and not self.data.path:
            raise ValueError(f"EvalConfig.data.path must be set when EvalConfig.every > 0 (got every={self.every})")
        if self.pass_k < 0:
            raise ValueError(f"EvalConfig.pass_k must be >= 0 (0 = greedy only), got {self.pass_k}")
        if self.num_samples is not None:
            if self.pass_k == 0:
                raise ValueError(f"EvalConfig.num_samples={self.num_samples} needs pass_k > 0")
            if self.num_samples < self.pass_k:
                raise ValueError(f"EvalConfig.num_samples must be >= pass_k={self.pass_k}, got {self.num_samples}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"EvalConfig.temperature must be > 0 and finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"EvalConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.seed < 0:
            raise ValueError(f"EvalConfig.seed must be >= 0, got {self.seed}")
        for name in ("max_tokens", "max_prompts"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"EvalConfig.{name} must be >= 1 or None, got {value}")
        if not self.timeout_s > 0:
            raise ValueError(f"EvalConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.reward not in EVAL_REWARDS:
            raise ValueError(f"EvalConfig.reward must be one of {list(EVAL_REWARDS)}, got {self.reward!r}")

    @property
    def enabled(self) -> bool:
        """True when the run evaluates at all."""
        return self.every > 0

    @property
    def samples_per_prompt(self) -> int:
        """n of pass@k: sampled completions per prompt (0 without pass@k)."""
        return self.num_samples if self.num_samples is not None else self.pass_k

    def is_due(self, step: int, num_steps: int) -> bool:
        """Whether to evaluate after optimizer step `step` (0-based) of a `num_steps`-step run."""
        if not self.enabled:
            return False
        done = step + 1
        return done % self.every == 0 or done == num_steps


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    The probability that k samples drawn without replacement from the n contain a correct one
    (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"). Exact integer
    binomials, so large n loses no precision.
    """
    if n < 1:
        raise ValueError(f"pass_at_k: n must be >= 1, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c must be in [0, n={n}], got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k must be in [1, n={n}] (pass@k needs at least k samples), got {k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def is_correct(sample: Sample) -> bool:
    """A completion counts as solved when its verdict says so (the full reward from math-verify, or
    every reward function's own notion of solved), whatever format bonus or penalty it got."""
    return counts_as_solved(sample.solved, sample.reward)


def pass_at_k_key(k: int) -> str:
    """Metric key of pass@k, e.g. 'eval/pass@4'."""
    return f"{METRIC_PREFIX}pass@{k}"


@dataclass(slots=True)
class PromptEvaluation:
    """What one held-out prompt got."""

    prompt: Sample
    """The prompt as loaded (no output)."""
    greedy: Sample
    """Its greedy completion, scored."""
    sampled: list[Sample]
    """Its pass@k completions, scored (empty without pass@k)."""


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def evaluation_metrics(prompts: Sequence[PromptEvaluation], pass_k: int, time_s: float) -> dict[str, float]:
    """The `eval/...` metrics of one evaluation.

    Greedy completions give accuracy, mean reward, response length and truncation; pass@k is
    averaged over prompts, each from its own sampled completions, and sampled_accuracy is the
    share of sampled completions that are correct (pass@1 at the sampling temperature).
    """
    if not prompts:
        raise ValueError("evaluation_metrics needs at least one prompt")
    greedy = [p.greedy for p in prompts]
    every_sample = greedy + [s for p in prompts for s in p.sampled]
    record = {
        "eval/accuracy": _mean([float(is_correct(s)) for s in greedy]),
        "eval/reward_mean": _mean([s.reward for s in greedy]),
        "eval/num_prompts": float(len(prompts)),
        "eval/mean_response_tokens": _mean([float(len(s.output_token_ids)) for s in greedy]),
        "eval/truncated_frac": _mean([float(s.truncated) for s in greedy]),
        "eval/reward_failures": float(sum(s.reward_failed for s in every_sample)),
        "eval/weight_version": float(min(s.weight_version for s in every_sample)),
        "eval/time_s": time_s,
    }
    if pass_k > 0:
        record[pass_at_k_key(pass_k)] = _mean(
            [pass_at_k(len(p.sampled), sum(is_correct(s) for s in p.sampled), pass_k) for p in prompts]
        )
        sampled = [s for p in prompts for s in p.sampled]
        record["eval/sampled_accuracy"] = _mean([float(is_correct(s)) for s in sampled])
    return record


@dataclass(slots=True)
class EvalResult:
    """One evaluation: every prompt's scored completions, and how long it took."""

    prompts: list[PromptEvaluation]
    """Per prompt, in the evaluation set's order."""
    pass_k: int
    """k of pass@k (0: greedy only)."""
    time_s: float
    """Wall time of the whole evaluation."""

    def metrics(self) -> dict[str, float]:
        """The `eval/...` metrics (see evaluation_metrics)."""
        return evaluation_metrics(self.prompts, self.pass_k, self.time_s)


def load_eval_prompts(config: EvalConfig, train_data: DatasetConfig, tokenizer: PromptTokenizer) -> list[Sample]:
    """The held-out prompts, validated like the training data (same tokenization settings; a bad
    line fails with file:line), capped at max_prompts."""
    if not config.data.path:
        raise ValueError("load_eval_prompts: EvalConfig.data.path is not set")
    max_prompt_tokens = config.data.max_prompt_tokens
    if max_prompt_tokens is None:
        max_prompt_tokens = train_data.max_prompt_tokens
    data = replace(train_data, path=config.data.path, max_prompt_tokens=max_prompt_tokens)
    if config.data.format is not None:  # the evaluation file's own layout
        data = replace(data, format=config.data.format, prompt_field=config.data.prompt_field,
                       answer_field=config.data.answer_field)
    prompts = load_prompts(data, tokenizer)
    if config.max_prompts is not None and config.max_prompts < len(prompts):
        logger.info("evaluating the first %d of %d prompts of %s", config.max_prompts, len(prompts), data.path)
        prompts = prompts[: config.max_prompts]
    return prompts


async def _gather_all(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Results in order. On the first error, or if the caller is cancelled, the others are
    cancelled and awaited, so no request (and no worker slot it holds) outlives the call."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Evaluator:
    """Greedy accuracy and pass@k of the served weights on a fixed prompt set (plain class).

    `sampling` is the training SamplingConfig: evaluation keeps its reward (unless EvalConfig.reward
    says math_verify), its truncated_reward, and max_tokens unless EvalConfig overrides them.
    """

    def __init__(self, config: EvalConfig, prompts: Sequence[Sample], sampling: SamplingConfig) -> None:
        if not prompts:
            raise ValueError("Evaluator needs at least one prompt")
        self.config = config
        self.prompts = list(prompts)
        max_tokens = config.max_tokens if config.max_tokens is not None else sampling.max_tokens
        if config.reward == "math_verify":  # RewardConfig without functions: math-verify's verdict
            sampling = replace(sampling, reward=replace(sampling.reward, functions=(), weights=(), by_data_source=(),
                                                        judge=JudgeConfig()))
        # Greedy decoding is deterministic: the seed would only make vLLM build a generator.
        self.greedy_sampling = replace(sampling, n=1, temperature=0.0, top_p=1.0, seed=None, max_tokens=max_tokens)
        self.sampled_sampling: SamplingConfig | None = None
        if config.pass_k > 0:
            self.sampled_sampling = replace(
                sampling, n=config.samples_per_prompt, temperature=config.temperature, top_p=config.top_p,
                seed=config.seed, max_tokens=max_tokens,
            )

    @classmethod
    def load(
        cls, config: EvalConfig, train_data: DatasetConfig, sampling: SamplingConfig, tokenizer: PromptTokenizer
    ) -> Evaluator:
        """An evaluator over config.data.path (see load_eval_prompts)."""
        return cls(config, load_eval_prompts(config, train_data, tokenizer), sampling)

    def run(self, client: RequestClient) -> EvalResult:
        """`evaluate` for synchronous callers such as the trainer loop (must not run inside an
        event loop). Ray ObjectRefs can be awaited from any loop, so RayRegistryClient works here."""
        return asyncio.run(self.evaluate(client))

    async def evaluate(self, client: RequestClient) -> EvalResult:
        """Send every prompt's requests at once, wait for all, return the scored completions.

        Raises EvaluationError if any request fails or the whole takes longer than timeout_s;
        the requests still running are cancelled first.
        """
        started = time.perf_counter()
        scope = asyncio.timeout(self.config.timeout_s)
        try:
            async with scope:
                evaluations = await _gather_all(self._evaluate_prompt(client, p) for p in self.prompts)
        except TimeoutError:
            if not scope.expired():
                raise
            raise EvaluationError(
                f"evaluation of {len(self.prompts)} prompts did not finish within EvalConfig.timeout_s="
                f"{self.config.timeout_s} s"
            ) from None
        result = EvalResult(prompts=evaluations, pass_k=self.config.pass_k, time_s=time.perf_counter() - started)
        self._log(result)
        return result

    async def _evaluate_prompt(self, client: RequestClient, prompt: Sample) -> PromptEvaluation:
        requests = [self._generate(client, prompt, self.greedy_sampling)]
        if self.sampled_sampling is not None:
            requests.append(self._generate(client, prompt, self.sampled_sampling))
        groups = await _gather_all(requests)
        return PromptEvaluation(prompt=prompt, greedy=groups[0][0], sampled=groups[1] if len(groups) > 1 else [])

    async def _generate(self, client: RequestClient, prompt: Sample, sampling: SamplingConfig) -> list[Sample]:
        """One generate request; errors name the prompt, so a failed evaluation says which one."""
        try:
            group = await client.submit(GENERATE_METHOD, prompt, sampling, cost=sampling.n)
        except Exception as exc:
            raise EvaluationError(
                f"eval prompt_id={prompt.prompt_id} ({'greedy' if sampling.temperature == 0 else 'sampled'}): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if len(group) != sampling.n:
            raise EvaluationError(
                f"eval prompt_id={prompt.prompt_id}: generate returned {len(group)} completions, asked for {sampling.n}"
            )
        return list(group)

    def _log(self, result: EvalResult) -> None:
        metrics = result.metrics()
        versions = {s.weight_version for p in result.prompts for s in [p.greedy, *p.sampled]}
        if len(versions) > 1:
            # The trainer evaluates between pushes; several versions mean a push ran meanwhile.
            logger.warning("evaluation saw several weight versions %s", sorted(versions))
        k = self.config.pass_k
        pass_k = f", pass@{k} {metrics[pass_at_k_key(k)]:.3f}" if k > 0 else ""
        logger.info(
            "eval on %d prompts (weights v%d): accuracy %.3f%s, %.1f response tokens, %.2f truncated, %.1f s",
            len(result.prompts), min(versions), metrics["eval/accuracy"], pass_k,
            metrics["eval/mean_response_tokens"], metrics["eval/truncated_frac"], result.time_s,
        )
