"""Scoring a generation worker's completed rollouts: verdicts, reward shaping, the verifier pool.

A group's completions get math-verify's verdict (the cluster's verifier pool) or the reward
functions of `SamplingConfig.reward`, run in the same pool's processes (the model judge, the
function named `judge`, through a judge client here: judge_reward.py); completions cut off at
max_tokens may get `truncated_reward` instead; the format bonus or penalty and the soft overlong
punishment shape the final reward (shaping.py). No engine here: GenerationWorker hands its
completed samples to a RolloutScorer, which tests can build with any RewardScorer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Callable, Protocol

from async_grpo.config.judge_config import JUDGE_FUNCTION, JudgeConfig
from async_grpo.config.reward_config import CORRECT_VERDICT, RewardConfig, function_name
from async_grpo.rewards.judge_reward import JudgeClient, JudgeItem, JudgeReward, JudgeStats
from async_grpo.rewards.math_verifier import RewardResult, quick_verdict
from async_grpo.rewards.reward_failure import FailureKind
from async_grpo.rewards.reward_functions import FunctionScore, failure
from async_grpo.rewards.shaping import (
    DEFAULT_REWARD_NAME, CombinedScore, ShapedReward, combine_scores, overlong_penalty, shape_reward,
)
from async_grpo.config.sampling import SamplingConfig
from sample_processing_utils import Sample

logger = logging.getLogger(__name__)


class RewardScorer(Protocol):
    """What the worker needs from a verifier: math_verify_pool.VerifierPool or math_verify_cluster.VerifierPoolClient."""

    async def score(self, completions: list[str], gt_answer: str) -> list[RewardResult]: ...

    async def score_function(self, ref: str, calls: list[dict[str, Any]],
                             timeout_s: float | None = None) -> list[FunctionScore]: ...


def reward_call(sample: Sample) -> dict[str, Any]:
    """The arguments of a reward function for one completed sample (reward_config.ARGUMENTS)."""
    return {
        "prompt": {**(sample.record or {}), "gt_answer": sample.gt_answer},
        "completion": sample.output_text,
        "token_ids": list(sample.output_token_ids),
        "metadata": {"prompt_id": sample.prompt_id, "group_id": sample.group_id, "run_id": sample.run_id,
                     "finish_reason": sample.finish_reason, "truncated": sample.truncated,
                     "weight_version": sample.weight_version},
    }


def shaped_rewards(samples: list[Sample], results: list[RewardResult], sampling: SamplingConfig) -> list[ShapedReward]:
    """Final rewards of one group: the verifier's verdicts plus the format bonus or penalty
    (rewards.shape_reward; completions given truncated_reward keep it unshaped), minus the soft
    overlong punishment (rewards.overlong_penalty) when sampling.overlong_buffer is set."""
    fixed = sampling.truncated_reward is not None
    shaped = []
    for s, r in zip(samples, results):
        final = shape_reward(r.reward, s.output_text, verified=not (s.truncated and fixed), config=sampling.reward)
        cut = overlong_penalty(s.num_sampled_tokens, sampling.max_tokens, sampling.overlong_buffer,
                               sampling.overlong_penalty)
        shaped.append(dataclasses.replace(final, reward=final.reward - cut) if cut else final)
    return shaped


class RolloutScorer:
    """The rewards of one worker's groups, from its verifier (connected on first use).

    With the cluster's verifier pool (no `verifier` given), answers that need no math-verify (plain
    numbers against a plain-number gold answer, and answers the pre-checks refuse:
    math_verifier.quick_verdict, which the pool itself applies first) are decided here, and only
    the rest make the call to the pool: on the demo every answer is a digit, and the call cost the
    pool actor ~0.07 CPU-s per step (benchmarks/step_profile.py, RESULTS.md).
    """

    def __init__(self, worker_name: str, connect: Callable[[], RewardScorer], verifier: RewardScorer | None = None,
                 count_in_worker: Callable[[int], None] | None = None,
                 connect_judge: Callable[[], JudgeClient] | None = None) -> None:
        """count_in_worker: told how many verdicts each call decided here (the worker's counter);
        connect_judge: the judge pool's client, connected on the first judged group (None: a
        config that names the judge fails its samples with kind crash)."""
        self.worker_name = worker_name
        self._connect = connect
        self._verifier = verifier
        self._decide_quick_verdicts = verifier is None
        self._count_in_worker = count_in_worker
        self._connect_judge = connect_judge
        self._judge_client: JudgeClient | None = None
        self._judges: dict[JudgeConfig, JudgeReward] = {}
        self.judge_stats = JudgeStats()
        """The judge's counters over every config this worker judged with (judge/* metrics)."""

    def _verifier_client(self) -> RewardScorer:
        if self._verifier is None:
            self._verifier = self._connect()
        return self._verifier

    async def verdicts(self, samples: list[Sample], gt_answer: str, sampling: SamplingConfig) -> list[RewardResult]:
        """Each completion's verdict: math-verify (score_completions), or the reward functions of
        sampling.reward; sets each sample's `solved` (the verdict's, before any shaping) and, with
        functions, its `reward_parts`. Completions given truncated_reward are unsolved."""
        fixed = [s.truncated and sampling.truncated_reward is not None for s in samples]
        functions, weights = sampling.reward.functions_for(samples[0].record if samples else None)
        if not functions:
            results = await self.score_completions(
                [s.output_text for s in samples], [s.truncated for s in samples], gt_answer, sampling.truncated_reward)
            for s, result, cut in zip(samples, results, fixed):
                s.solved = not cut and not result.failed and result.reward >= CORRECT_VERDICT
                if result.failed:
                    s.reward_failure_reasons = [f"{DEFAULT_REWARD_NAME}/{result.kind}"]
            return results
        results = [RewardResult(reward=float(sampling.truncated_reward), failed=False, error="") if cut else None
                   for cut in fixed]
        pending = [i for i, cut in enumerate(fixed) if not cut]
        combined = await self._score_functions([samples[i] for i in pending], functions, weights, sampling.reward)
        for i, verdict in zip(pending, combined):
            samples[i].reward_parts = verdict.parts
            samples[i].reward_failure_reasons = list(verdict.failure_reasons) or None
            samples[i].reward_masked = verdict.masked
            results[i] = RewardResult(reward=verdict.reward, failed=bool(verdict.errors), error="; ".join(verdict.errors))
        for s, verdict in zip((samples[i] for i in pending), combined):
            s.solved = verdict.solved
        for i in set(range(len(samples))) - set(pending):
            samples[i].solved = False
        return [r for r in results if r is not None]

    async def _score_functions(self, samples: list[Sample], functions: tuple[str, ...], weights: tuple[float, ...],
                               reward: RewardConfig) -> list[CombinedScore]:
        """The reward functions' combined verdicts on samples (one group), from the verifier pool's
        processes and the judge; a failure masks a sample where reward.masks_failure says so."""
        if not samples:
            return []
        calls = [reward_call(s) for s in samples]
        per_function = await asyncio.gather(*(
            self._judge_scores(samples, reward.judge) if ref == JUDGE_FUNCTION
            else self._function_scores(ref, calls, reward.function_timeout_s) for ref in functions))
        names = [function_name(ref) for ref in functions]
        masking = [reward.masks_failure(ref) for ref in functions]
        agreement = (JUDGE_FUNCTION, reward.judge.agree_with) if reward.judge.agree_with is not None else None
        return [combine_scores(names, weights, [scores[j] for scores in per_function], masking, agreement)
                for j in range(len(calls))]

    async def _function_scores(self, ref: str, calls: list[dict[str, Any]], timeout_s: float | None) -> list[FunctionScore]:
        try:
            return await self._verifier_client().score_function(ref, calls, timeout_s)
        except Exception as exc:
            logger.exception("%s: verifier pool call failed", self.worker_name)
            return [failure("crash", f"verifier pool failed: {type(exc).__name__}: {exc}")] * len(calls)

    async def _judge_scores(self, samples: list[Sample], config: JudgeConfig) -> list[FunctionScore]:
        """The judge's scores of one group's samples (JudgeReward: per sample, or the group in one
        request); sets each sample's judge_usage."""
        try:
            judge = self._judges.get(config)
            if judge is None:
                if self._connect_judge is None:
                    raise RuntimeError("the reward names the judge but this worker has no judge client")
                if self._judge_client is None:
                    self._judge_client = self._connect_judge()
                judge = self._judges[config] = JudgeReward(config, self._judge_client, self.judge_stats)
            judged = await judge.score_with_usage(
                [JudgeItem(record=s.record, completion=s.output_text, gt_answer=s.gt_answer) for s in samples])
            for sample, (_, usage) in zip(samples, judged):
                sample.judge_usage = usage
            return [score for score, _ in judged]
        except Exception as exc:
            logger.exception("%s: judge call failed", self.worker_name)
            return [failure("crash", f"judge failed: {type(exc).__name__}: {exc}")] * len(samples)

    async def score_completions(
        self, completions: list[str], truncated: list[bool], gt_answer: str, truncated_reward: float | None
    ) -> list[RewardResult]:
        """Rewards of one group: truncated completions get truncated_reward (unless None), the
        rest go to the verifier pool. A verifier-pool failure fails every reward of the call."""
        if len(completions) != len(truncated):
            raise ValueError(f"{len(completions)} completions but {len(truncated)} truncated flags")
        results: list[RewardResult | None] = [
            RewardResult(reward=float(truncated_reward), failed=False, error="")
            if cut and truncated_reward is not None
            else None
            for cut in truncated
        ]
        pending = [i for i, r in enumerate(results) if r is None]
        if pending:
            for i, result in zip(pending, await self.verify([completions[i] for i in pending], gt_answer)):
                results[i] = result
        return [r for r in results if r is not None]

    async def verify(self, completions: list[str], gt_answer: str, in_worker: bool = True) -> list[RewardResult]:
        """Verdicts of `completions` against `gt_answer`: the quick ones here (see the class
        docstring; in_worker False sends every one to the verifier), the rest from the verifier."""
        quick = [quick_verdict(c, gt_answer) if in_worker and self._decide_quick_verdicts else None
                 for c in completions]
        pending = [i for i, verdict in enumerate(quick) if verdict is None]
        if self._count_in_worker is not None:
            self._count_in_worker(len(completions) - len(pending))
        if not pending:
            return [verdict for verdict in quick if verdict is not None]
        scored = iter(await self._pool_verdicts([completions[i] for i in pending], gt_answer))
        return [verdict if verdict is not None else next(scored) for verdict in quick]

    async def _pool_verdicts(self, completions: list[str], gt_answer: str) -> list[RewardResult]:
        try:
            results = await self._verifier_client().score(completions, gt_answer)
        except Exception as exc:
            logger.exception("%s: verifier pool call failed", self.worker_name)
            error = f"verifier pool failed: {type(exc).__name__}: {exc}"
            return [RewardResult(reward=0.0, failed=True, error=error, kind=FailureKind.CRASH) for _ in completions]
        if len(results) != len(completions):
            raise RuntimeError(f"verifier returned {len(results)} results for {len(completions)} completions")
        return list(results)
