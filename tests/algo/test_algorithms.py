"""Algorithm options (issue 12): advantage estimators, KL in the reward and its controller, the
prepare hook, grouping by (group_id, run_id), dynamic sampling, truncated-sample masking, and
the sampler's exact data order when extra prompts are drawn.

Numbers are checked against values worked out by hand (or written out with plain Python here),
never against the code under test. Batcher tests run the plain `ExperienceBatcher` on asyncio
with in-process stand-ins for the registries, whose rewards the test chooses.

    .venv/bin/python -m pytest tests/algo/test_algorithms.py -q
"""

from __future__ import annotations

import asyncio
import math
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

from async_grpo.algo.advantages import batch_normalised_advantages, estimate, group_advantages, leave_one_out_advantages
from async_grpo.algo.algorithm import (
    AlgorithmConfig, AlgorithmContext, DistillConfig, KLController, KLSchedule, PreparedSamples, builtin_prepare,
    check_prepared, load_prepare_fn,
)
from async_grpo.batching.batcher_config import BatcherConfig, ExperienceConfig
from async_grpo.config.sampling import SamplingConfig
from async_grpo.trainer.distributed_sampler import InfiniteDistributedSampler
from grpo_loss import LossConfig, step_divisor
from sample_processing_utils import Sample, TokenLogprobs, post_process_batch
from vllm_experience_batcher import EndOfStep, ExperienceBatcher, Minibatch, PromptRequest

_WAIT_BOUND_S = 60.0  # a broken batcher fails the test instead of hanging it; never what decides a pass

# ------------------------------------------------------------------------------------------
# 1. Estimators against hand-computed values
# ------------------------------------------------------------------------------------------


def test_grpo_and_dr_grpo_by_hand() -> None:
    # rewards 1, 0, 0, 1: mean 0.5, population std 0.5
    assert group_advantages([1, 0, 0, 1], scale_by_std=True, eps=0.0) == pytest.approx([1, -1, -1, 1])
    assert estimate("grpo", [1, 0, 0, 1], eps=0.0) == pytest.approx([1, -1, -1, 1])
    assert estimate("dr_grpo", [1, 0, 0, 1], eps=0.0) == pytest.approx([0.5, -0.5, -0.5, 0.5])
    # rewards 2, 0, 1: mean 1, std sqrt(2/3); eps 0.1 added to the std
    std = math.sqrt(2 / 3)
    assert estimate("grpo", [2, 0, 1], eps=0.1) == pytest.approx([1 / (std + 0.1), -1 / (std + 0.1), 0.0])


def test_rloo_by_hand() -> None:
    # r = 1, 0, 0, 1: the others' means are 1/3, 2/3, 2/3, 1/3
    assert leave_one_out_advantages([1, 0, 0, 1]) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # r = 3, 1, 2: others' means 1.5, 2.5, 2
    assert estimate("rloo", [3, 1, 2], eps=0.0) == pytest.approx([1.5, -1.5, 0.0])


def test_reinforce_pp_whitens_over_the_batch_by_hand() -> None:
    # r = 1, 1, 1, 0 over the batch: mean 0.75, std sqrt(0.1875)
    std = math.sqrt(0.1875)
    expected = [0.25 / std, 0.25 / std, 0.25 / std, -0.75 / std]
    assert batch_normalised_advantages([1, 1, 1, 0], eps=0.0) == pytest.approx(expected)
    assert estimate("reinforce_pp", [1, 1, 1, 0], eps=0.0) == pytest.approx(expected)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_groups_of_one_and_equal_rewards_give_exactly_zero(estimator: str) -> None:
    assert estimate(estimator, [0.1, 0.1, 0.1], eps=0.0) == [0.0, 0.0, 0.0]  # 0.1 is inexact in binary
    assert estimate(estimator, [], eps=1e-4) == []
    if estimator != "reinforce_pp":  # a batch of one is a batch; a group of one has no baseline
        assert estimate(estimator, [0.7], eps=1e-4) == [0.0]


def test_unknown_estimator_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="rloo"):
        estimate("ppo", [1.0], eps=0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="AlgorithmConfig.estimator"):
        AlgorithmConfig(estimator="ppo")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------
# 2. KL in the reward: controller, schedule, built-in prepare
# ------------------------------------------------------------------------------------------


def test_adaptive_controller_by_hand() -> None:
    controller = KLController(LossConfig(kl_coef=0.1, kl_controller="adaptive", target_kl=2.0, kl_horizon=100, kl_in_reward=True))
    controller.update(measured_kl=3.0, num_samples=10)  # error 0.5 clipped to 0.2: x (1 + 0.2 * 10/100)
    assert controller.beta == pytest.approx(0.1 * 1.02)
    controller.update(measured_kl=1.9, num_samples=50)  # error -0.05: x (1 - 0.05 * 0.5)
    assert controller.beta == pytest.approx(0.1 * 1.02 * 0.975)
    fixed = KLController(LossConfig(kl_coef=0.1, kl_in_reward=True))
    fixed.update(measured_kl=100.0, num_samples=1000)
    assert fixed.beta == 0.1


@pytest.mark.parametrize("max_lag", [0, 1, 2])
def test_kl_schedule_lags_and_resumes_to_the_same_betas(max_lag: int) -> None:
    """Step s uses beta after the updates of steps <= s - 1 - max_lag; a schedule restored from
    state_for(k), taken once step k - 1 has finished, gives steps >= k the same betas."""
    config = LossConfig(kl_coef=0.2, kl_controller="adaptive", target_kl=1.0, kl_horizon=10, kl_in_reward=True)
    kls = [3.0, 0.5, 2.0, 0.1, 1.5, 4.0, 0.2, 1.0]

    def expected_beta(step: int) -> float:
        beta = 0.2
        for t in range(0, step - max_lag):  # each step: 5 samples, error clipped to +-0.2
            beta *= 1 + max(-0.2, min(0.2, kls[t] - 1)) * 5 / 10
        return beta

    def run(schedule: KLSchedule, first: int, resume_at: int | None = None) -> tuple[list[float], dict | None]:
        """As in a run: step s is created once step s - 1 - max_lag has finished (recorded)."""
        betas, saved = [], None
        for step in range(first, len(kls)):
            done = step - 1 - max_lag
            if done >= first - 1 - max_lag + (1 if first else 0) and done >= 0 and (first == 0 or done >= first):
                schedule.record(done, kls[done], 5)
            if resume_at is not None and done == resume_at - 1:
                saved = schedule.state_for(resume_at)
            betas.append(schedule.beta_for(step))
        return betas, saved

    betas, saved = run(KLSchedule(config, max_lag), 0, resume_at=4)
    assert betas == pytest.approx([expected_beta(s) for s in range(len(kls))])
    assert saved is not None
    restored = KLSchedule(config, max_lag)
    restored.load_state_dict(saved)
    resumed, _ = run(restored, 4)
    assert resumed == pytest.approx([expected_beta(s) for s in range(4, len(kls))])


def _scored(prompt_id: int, rewards: list[float], policy: list[list[float]], ref: list[list[float]], **kw) -> list[Sample]:
    return [
        Sample(input_token_ids=[1, 2], gt_answer="", prompt_id=prompt_id, output_token_ids=[3] * len(p),
               sampling_logprobs=p, ref_logprobs=r, reward=reward, **kw)
        for reward, p, r in zip(rewards, policy, ref)
    ]


def test_builtin_prepare_puts_beta_times_sequence_kl_in_the_reward() -> None:
    # KL per sample = sum(policy - ref): sample 0: (-1 + 1.5) + (-2 + 2) = 0.5; sample 1: (-0.5 + 0.5) = 0
    samples = _scored(0, [1.0, 1.0], [[-1.0, -2.0], [-0.5]], [[-1.5, -2.0], [-0.5]])
    ctx = AlgorithmContext(step=0, config=AlgorithmConfig(estimator="dr_grpo"), kl_beta=0.4)
    prepared = builtin_prepare(samples, ctx)
    # rewards after KL: 1 - 0.2 = 0.8 and 1.0; mean 0.9
    assert [s.advantage for s in prepared.samples] == pytest.approx([-0.1, 0.1])
    # Without the KL the equal rewards carry no signal.
    plain = builtin_prepare(_scored(0, [1.0, 1.0], [[-1.0], [-2.0]], [[-1.0], [-1.0]]),
                            AlgorithmContext(step=0, config=AlgorithmConfig()))
    assert [s.advantage for s in plain.samples] == [0.0, 0.0]


# ------------------------------------------------------------------------------------------
# 3. The prepare hook: loading and validation
# ------------------------------------------------------------------------------------------


@pytest.fixture()
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A user's algorithm module on the import path: a median baseline with per-token credit."""
    (tmp_path / "my_algos.py").write_text(textwrap.dedent('''
        import statistics
        from async_grpo.algo.algorithm import PreparedSamples

        def median_baseline(samples, ctx):
            median = statistics.median(s.reward for s in samples)
            for s in samples:
                s.advantage = s.reward - median
                # dense credit: later tokens count double
                s.token_advantages = [s.advantage * (1 + (t > 0)) for t in range(len(s.output_token_ids))]
            return PreparedSamples(samples=samples, metrics={"median": median, "step": float(ctx.step)})

        def drop_first(samples, ctx):
            for s in samples:
                s.advantage = s.reward
            return PreparedSamples(samples=samples[1:])

        def returns_list(samples, ctx):
            return samples

        not_a_function = 3
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_algos"
    sys.modules.pop("my_algos", None)


def test_load_prepare_fn_reports_bad_specs_naming_them(user_module: str) -> None:
    assert load_prepare_fn(AlgorithmConfig()) is builtin_prepare
    assert load_prepare_fn(AlgorithmConfig(prepare_batch=f"{user_module}:median_baseline")).__name__ == "median_baseline"
    with pytest.raises(ValueError, match="no_such_module"):
        load_prepare_fn(AlgorithmConfig(prepare_batch="no_such_module:fn"))
    with pytest.raises(ValueError, match="has no function missing"):
        load_prepare_fn(AlgorithmConfig(prepare_batch=f"{user_module}:missing"))
    with pytest.raises(ValueError, match="has no function not_a_function"):
        load_prepare_fn(AlgorithmConfig(prepare_batch=f"{user_module}:not_a_function"))
    with pytest.raises(ValueError, match="module:function"):
        AlgorithmConfig(prepare_batch="my_algos.median_baseline")


def test_check_prepared_refuses_bad_answers() -> None:
    samples = _scored(0, [1.0, 0.0], [[-1.0], [-1.0, -1.0]], [[-1.0], [-1.0, -1.0]])
    with pytest.raises(TypeError, match="PreparedSamples"):
        check_prepared(samples, samples, "f")
    stranger = _scored(9, [1.0], [[-1.0]], [[-1.0]])
    with pytest.raises(ValueError, match="not given"):
        check_prepared(PreparedSamples(samples=stranger), samples, "f")
    samples[1].token_advantages = [1.0]
    with pytest.raises(ValueError, match="1 token_advantages for 2 output tokens"):
        check_prepared(PreparedSamples(samples=samples), samples, "f")
    samples[1].token_advantages = None
    samples[0].advantage = float("nan")
    with pytest.raises(ValueError, match="advantage nan"):
        check_prepared(PreparedSamples(samples=samples), samples, "f")


def test_token_advantages_replace_the_scalar_in_the_packed_batch() -> None:
    a, b = _scored(0, [1.0, 0.0], [[-1.0, -1.0], [-1.0]], [[-1.0, -1.0], [-1.0]])
    a.advantage, a.token_advantages, b.advantage = 5.0, [0.5, -0.25], 2.0
    assert post_process_batch([a, b]).advantages.tolist() == [0.5, -0.25, 2.0]


# ------------------------------------------------------------------------------------------
# 4. The batcher runs the algorithm: grouping, scopes, hook, dynamic sampling, masking
# ------------------------------------------------------------------------------------------


@dataclass
class RewardGeneration:
    """Generation stand-in: n rollouts of 2 output tokens each, rewards from reward_of(prompt, i)."""

    reward_of: Callable[[Sample, int], float]
    truncated_of: Callable[[Sample, int], bool] = lambda prompt, i: False
    version: int = 0
    """Weight version of every rollout (max_lag is 0 in these tests: the step's own)."""
    calls: list[int] = field(default_factory=list)

    async def submit(self, method: str, *args: Any, cost: int) -> list[Sample]:
        prompt, sampling = args
        self.calls.append(prompt.prompt_id)
        return [
            Sample(input_token_ids=list(prompt.input_token_ids), gt_answer="", prompt_id=prompt.prompt_id,
                   group_id=prompt.group_id, run_id=prompt.run_id, output_token_ids=[5, 6],
                   sampling_logprobs=[-1.0, -1.0], reward=self.reward_of(prompt, i),
                   truncated=self.truncated_of(prompt, i), weight_version=self.version)
            for i in range(sampling.n)
        ]


class RefLogprob:
    """Reference stand-in: logprob -1.5 per token, so each 2-token rollout's KL is 2 x 0.5 = 1."""

    async def submit(self, method: str, *args: Any, cost: int) -> list[TokenLogprobs]:
        (rollouts,) = args
        return [TokenLogprobs(weight_version=-1, values=[-1.5] * len(r.output_token_ids)) for r in rollouts]


def _batcher(generation: RewardGeneration, *, world_size: int = 1, n: int = 2, logprob: bool = False,
             algorithm: AlgorithmConfig | None = None, **overrides: Any) -> ExperienceBatcher:
    sampling = overrides.pop("sampling", SamplingConfig(n=n))
    experience = ExperienceConfig(max_tokens_per_gpu=64, prompt_deadline_s=_WAIT_BOUND_S, sampling=sampling,
                                  logprob_role="reference" if logprob else "none", max_lag=0,
                                  algorithm=algorithm or AlgorithmConfig())
    config = BatcherConfig(world_size=world_size, experience=experience, reorder_window=0, **overrides)
    return ExperienceBatcher(config, generation, RefLogprob() if logprob else None)


def _prompt(prompt_id: int, group_id: int | None = None, run_id: int = 0) -> Sample:
    return Sample(input_token_ids=[1, 2, 3], gt_answer="", prompt_id=prompt_id, group_id=group_id, run_id=run_id)


async def _drain(batcher: ExperienceBatcher, rank: int, step: int,
                 answer: Callable[[PromptRequest], list[Sample]] | None = None,
                 seen_before_requests: list[int] | None = None) -> tuple[list[Sample], EndOfStep]:
    """Read a rank's step; answer PromptRequests with `answer` as a trainer rank would, noting in
    `seen_before_requests` how many minibatches (padding included) came before each."""
    trained: list[Sample] = []
    seen = 0
    while True:
        message = await asyncio.wait_for(batcher.next_message(rank, step), _WAIT_BOUND_S)
        if isinstance(message, EndOfStep):
            return trained, message
        if isinstance(message, PromptRequest):
            assert answer is not None, "unexpected PromptRequest"
            if seen_before_requests is not None:
                seen_before_requests.append(seen)
            await batcher.submit_prompts(rank, step, answer(message), message.round_index)
            continue
        assert isinstance(message, Minibatch)
        seen += 1
        if message.loss_weight > 0:
            trained.extend(message.samples)


def test_batcher_groups_by_group_id_and_run_id() -> None:
    """Prompts 0 and 1 are one problem (group 7) under two runs; prompt 2 repeats run 0 of it
    from the other rank: run 0 is one group of 4 rollouts, run 1 one of 2."""
    rewards = {(0, 0): 1.0, (0, 1): 0.0, (1, 0): 1.0, (1, 1): 1.0, (2, 0): 0.0, (2, 1): 0.0}

    async def scenario() -> list[Sample]:
        batcher = _batcher(RewardGeneration(lambda p, i: rewards[(p.prompt_id, i)]), world_size=2,
                           algorithm=AlgorithmConfig(estimator="dr_grpo"))
        await batcher.submit_prompts(0, 0, [_prompt(0, group_id=7, run_id=0), _prompt(1, group_id=7, run_id=1)])
        await batcher.submit_prompts(1, 0, [_prompt(2, group_id=7, run_id=0)])
        (a, _), (b, _) = await asyncio.gather(_drain(batcher, 0, 0), _drain(batcher, 1, 0))
        return a + b

    trained = asyncio.run(scenario())
    by_id = {(s.prompt_id, s.reward): s.advantage for s in trained}
    # run 0: rewards 1, 0, 0, 0 (prompts 0 and 2): mean 0.25
    assert by_id[(0, 1.0)] == pytest.approx(0.75) and by_id[(0, 0.0)] == pytest.approx(-0.25)
    assert by_id[(2, 0.0)] == pytest.approx(-0.25)
    # run 1: rewards 1, 1: no signal
    assert [s.advantage for s in trained if s.prompt_id == 1] == [0.0, 0.0]
    assert {(s.group_key) for s in trained} == {(7, 0), (7, 1)}


def test_reinforce_pp_waits_for_the_step_and_whitens_over_it() -> None:
    rewards = {0: [1.0, 1.0], 1: [1.0, 0.0]}

    async def scenario() -> tuple[list[Sample], dict[str, float]]:
        batcher = _batcher(RewardGeneration(lambda p, i: rewards[p.prompt_id][i]),
                           algorithm=AlgorithmConfig(estimator="reinforce_pp", advantage_eps=0.0))
        await batcher.submit_prompts(0, 0, [_prompt(0), _prompt(1)])
        trained, _ = await _drain(batcher, 0, 0)
        return trained, batcher.stats(0)

    trained, _ = asyncio.run(scenario())
    std = math.sqrt(0.1875)  # rewards 1, 1, 1, 0 over the step
    assert sorted(s.advantage for s in trained) == pytest.approx(sorted([0.25 / std] * 3 + [-0.75 / std]))


def test_user_prepare_function_runs_per_group_with_its_metrics(user_module: str) -> None:
    rewards = {0: [1.0, 0.0, 0.0], 1: [2.0, 2.0, 5.0]}

    async def scenario() -> tuple[list[Sample], dict[str, float]]:
        batcher = _batcher(RewardGeneration(lambda p, i: rewards[p.prompt_id][i], version=3), n=3,
                           algorithm=AlgorithmConfig(prepare_batch=f"{user_module}:median_baseline"))
        await batcher.submit_prompts(0, 3, [_prompt(0), _prompt(1)])
        trained, _ = await _drain(batcher, 0, 3)
        return trained, batcher.stats(3)

    trained, stats = asyncio.run(scenario())
    got = sorted((s.prompt_id, s.reward, tuple(s.token_advantages)) for s in trained)
    assert got == [(0, 0.0, (0.0, 0.0)), (0, 0.0, (0.0, 0.0)), (0, 1.0, (1.0, 2.0)),
                   (1, 2.0, (0.0, 0.0)), (1, 2.0, (0.0, 0.0)), (1, 5.0, (3.0, 6.0))]
    assert stats["algorithm/median"] == pytest.approx(1.0)  # medians 0 and 2, 3 samples each
    assert stats["algorithm/step"] == 3.0


def test_samples_a_prepare_function_drops_are_counted(user_module: str) -> None:
    async def scenario() -> tuple[list[Sample], EndOfStep]:
        batcher = _batcher(RewardGeneration(lambda p, i: float(i)), n=3,
                           algorithm=AlgorithmConfig(prepare_batch=f"{user_module}:drop_first"))
        await batcher.submit_prompts(0, 0, [_prompt(0), _prompt(1)])
        return await _drain(batcher, 0, 0)

    trained, end = asyncio.run(scenario())
    assert (len(trained), end.num_samples, end.prepare_dropped) == (4, 4, 2)


def test_a_prepare_function_that_breaks_fails_the_step_naming_it(user_module: str) -> None:
    async def scenario() -> None:
        batcher = _batcher(RewardGeneration(lambda p, i: 1.0),
                           algorithm=AlgorithmConfig(prepare_batch=f"{user_module}:returns_list"))
        await batcher.submit_prompts(0, 0, [_prompt(0)])
        await _drain(batcher, 0, 0)

    with pytest.raises(Exception, match="returns_list returned list, not PreparedSamples"):
        asyncio.run(scenario())


def test_dynamic_sampling_replaces_zero_variance_groups_from_the_data_order() -> None:
    """Even prompt ids all score 1 (no signal), odd ones split. 2 ranks x 2 prompts. Round 0: 1 and 3
    informative (2 of 4), so each rank is asked for 1 more. Rank 0's data order always gives 101
    (informative), rank 1's gives 102, then 104 (not). Round 1: 3 of 4; round 2: 4 of 4."""
    next_id = {0: 101, 1: 102}

    def answer(rank: int) -> Callable[[PromptRequest], list[Sample]]:
        def draw(request: PromptRequest) -> list[Sample]:
            prompts = [_prompt(next_id[rank] + 2 * k) for k in range(request.count)]
            next_id[rank] += 2 * request.count if rank == 1 else 0
            return prompts
        return draw

    async def scenario() -> tuple[list[Sample], EndOfStep, dict[str, float]]:
        generation = RewardGeneration(lambda p, i: 1.0 if p.prompt_id % 2 == 0 else float(i % 2))
        sampling = SamplingConfig(n=2, drop_zero_variance_groups=True, max_resample_rounds=2)
        batcher = _batcher(generation, world_size=2, sampling=sampling)
        await batcher.submit_prompts(0, 0, [_prompt(0), _prompt(1)])
        await batcher.submit_prompts(1, 0, [_prompt(2), _prompt(3)])
        (a, end), (b, _) = await asyncio.gather(_drain(batcher, 0, 0, answer(0), seen[0]),
                                                _drain(batcher, 1, 0, answer(1), seen[1]))
        return a + b, end, batcher.stats(0)

    seen: list[list[int]] = [[], []]
    trained, end, stats = asyncio.run(scenario())
    # Both ranks have run the same minibatches when a request reaches them (no rank can wait in a
    # collective its peer never joins), and some minibatches did go out before the requests.
    assert seen[0] == seen[1] and len(seen[0]) == 2 and seen[0][-1] > 0
    assert sorted({s.prompt_id for s in trained}) == [1, 3, 101]
    assert end.dropped_zero_variance_groups == 4  # 0, 2, 102, 104
    assert end.resampled_prompts == 4 and end.num_prompts == 8
    assert end.num_samples == len(trained) == 8  # zero-variance groups are neither trained nor counted
    assert all(s.advantage != 0.0 for s in trained)
    assert stats["counts/dropped_zero_variance_groups"] == 4 and stats["counts/resampled_prompts"] == 4
    # every generated rollout: 8 informative ones at mean 0.5, 8 of all-1 groups (0, 2, 102, 104)
    assert stats["reward/mean_generated"] == pytest.approx((8 * 0.5 + 8 * 1.0) / 16)


def test_dynamic_sampling_stops_after_max_resample_rounds() -> None:
    async def scenario() -> EndOfStep:
        sampling = SamplingConfig(n=2, drop_zero_variance_groups=True, max_resample_rounds=1)
        batcher = _batcher(RewardGeneration(lambda p, i: 0.0), sampling=sampling)
        await batcher.submit_prompts(0, 0, [_prompt(0), _prompt(1)])
        _, end = await _drain(batcher, 0, 0, lambda request: [_prompt(10 + k) for k in range(request.count)])
        return end

    end = asyncio.run(scenario())
    assert (end.num_samples, end.dropped_zero_variance_groups, end.resampled_prompts) == (0, 4, 2)


def test_mask_truncated_keeps_truncated_samples_out_of_the_loss_but_in_the_baseline() -> None:
    async def scenario() -> tuple[list[Sample], EndOfStep, dict[str, float]]:
        generation = RewardGeneration(lambda p, i: [1.0, 0.0, 0.0, 0.0][i], truncated_of=lambda p, i: i == 3)
        # every rollout has 2 tokens, over max_tokens 3 - overlong_buffer 2: all 4 count as penalised
        sampling = SamplingConfig(n=4, max_tokens=3, mask_truncated=True, overlong_buffer=2)
        batcher = _batcher(generation, n=4, sampling=sampling, algorithm=AlgorithmConfig(estimator="dr_grpo"))
        await batcher.submit_prompts(0, 0, [_prompt(0)])
        return (*await _drain(batcher, 0, 0), batcher.stats(0))

    trained, end, stats = asyncio.run(scenario())
    assert sorted(s.advantage for s in trained) == pytest.approx([-0.25, -0.25, 0.75])  # mean 0.25 over all 4
    assert (end.num_samples, end.masked_truncated, end.num_output_tokens) == (3, 1, 6)
    assert (stats["counts/masked_truncated"], stats["counts/overlong_penalised"]) == (1, 4)


def test_kl_in_reward_uses_the_scheduled_beta_and_reports_it() -> None:
    """Each rollout's KL is 1 (RefLogprob). Adaptive: target 0.5, horizon 4, 2 samples per step ->
    beta x (1 + 0.2 x 2/4) = x 1.1 after each step (max_lag 0)."""
    async def scenario() -> list[dict[str, float]]:
        generation = RewardGeneration(lambda p, i: float(i))
        batcher = _batcher(generation, logprob=True,
                           kl_in_reward=LossConfig(kl_coef=0.5, kl_controller="adaptive", target_kl=0.5, kl_horizon=4, kl_in_reward=True))
        stats = []
        for step in range(3):
            generation.version = step
            await batcher.submit_prompts(0, step, [_prompt(step)])
            trained, _ = await _drain(batcher, 0, step)
            # rewards 0 and 1 minus beta x 1 each: the baseline removes the common shift
            assert sorted(s.advantage for s in trained) == pytest.approx([-1.0, 1.0], abs=1e-3)
            stats.append(batcher.stats(step))
        return stats

    stats = asyncio.run(scenario())
    assert [s["kl/beta"] for s in stats] == pytest.approx([0.5, 0.55, 0.605])
    assert [s["kl/in_reward_mean"] for s in stats] == pytest.approx([1.0, 1.0, 1.0])


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="KL term in the reward .* needs reference logprobs"):
        BatcherConfig(world_size=1, experience=ExperienceConfig(max_tokens_per_gpu=8, prompt_deadline_s=1.0,
                                                                sampling=SamplingConfig(), logprob_role="old_policy"),
                      kl_in_reward=LossConfig(kl_coef=0.1, kl_in_reward=True))
    with pytest.raises(ValueError, match="kl_in_reward needs kl_coef > 0"):
        LossConfig(kl_in_reward=True)
    with pytest.raises(ValueError, match="target_kl"):
        LossConfig(kl_coef=0.1, kl_in_reward=True, kl_controller="adaptive", target_kl=0.0)
    with pytest.raises(ValueError, match="needs the whole step"):
        AlgorithmConfig(estimator="reinforce_pp", prepare_scope="group")


def test_step_divisor_by_aggregation() -> None:
    assert step_divisor("sample_mean", 4, 30, 16) == 4
    assert step_divisor("token_mean", 4, 30, 16) == 30
    assert step_divisor("constant", 4, 30, 16) == 64


# ------------------------------------------------------------------------------------------
# 5. The data order with extra prompts: exactly once across a resume
# ------------------------------------------------------------------------------------------


def test_sampler_resume_passes_over_extras_already_trained() -> None:
    """Draw order under max_lag 1: main(0) main(1) extra(0) main(2) extra(1) main(3). A crash after
    step 1 trained resumes at step 2 from the state before main(2), passing over extra(1) (drawn
    after it, already trained): every index is trained exactly once."""
    sampler = InfiniteDistributedSampler(num_items=12, rank=0, world_size=1, seed=3)
    main0, main1 = sampler.next_batch(2), sampler.next_batch(2)
    extra0 = sampler.next_drawn(1)
    state_before_main2 = sampler.state_dict()
    sampler.next_batch(2)  # main(2): in flight at the crash
    extra1 = sampler.next_drawn(1)
    trained = main0 + main1 + [i for i, _ in extra0 + extra1]

    resume = InfiniteDistributedSampler.with_skipped(
        state_before_main2, [where for _, where in extra0 + extra1])  # extras of steps < 2
    resumed = InfiniteDistributedSampler(num_items=12, rank=0, world_size=1, seed=3)
    resumed.load_state_dict(resume)
    after = resumed.next_batch(12 - len(trained))
    assert sorted(trained + after) == list(range(12))  # the first epoch, each index once
    assert resumed.state_dict()["skip"] == []


def test_dataset_records_may_carry_group_and_run_ids(tmp_path: Path, tiny_model_dir: Path) -> None:
    from async_grpo.data.dataset import DatasetConfig, DatasetError, load_prompts
    from setup_model import load_tokenizer

    path = tmp_path / "variants.jsonl"
    path.write_text('{"prompt": "1+1=", "gt_answer": "2", "group_id": 5, "run_id": 1}\n'
                    '{"prompt": "2+2=", "gt_answer": "4"}\n')
    tokenizer = load_tokenizer(tiny_model_dir)
    first, second = load_prompts(DatasetConfig(path=str(path)), tokenizer)
    assert (first.group_key, second.group_key) == ((5, 1), (second.prompt_id, 0))
    path.write_text('{"prompt": "1+1=", "gt_answer": "2", "run_id": -1}\n')
    with pytest.raises(DatasetError, match="run_id"):
        load_prompts(DatasetConfig(path=str(path)), tokenizer)


# ------------------------------------------------------------------------------------------
# 6. Reference logprobs beside old-policy ones: the reference pool, and the KL's policy side
# ------------------------------------------------------------------------------------------


class OldLogprob:
    """Old-policy stand-in: -1.25 per token, at the rollout's own weight version."""

    async def submit(self, method: str, *args: Any, cost: int) -> list[TokenLogprobs]:
        (rollouts,) = args
        return [TokenLogprobs(weight_version=r.weight_version, values=[-1.25] * len(r.output_token_ids))
                for r in rollouts]


class FrozenReference:
    """Reference-pool stand-in: -1.5 per token from the checkpoint, or a wrong weight version."""

    def __init__(self, version: int = -1) -> None:
        self.version = version
        self.calls = 0

    async def submit(self, method: str, *args: Any, cost: int) -> list[TokenLogprobs]:
        (rollouts,) = args
        self.calls += 1
        return [TokenLogprobs(weight_version=self.version, values=[-1.5] * len(r.output_token_ids)) for r in rollouts]


def _old_policy_batcher(reference: FrozenReference, policy: str) -> ExperienceBatcher:
    experience = ExperienceConfig(max_tokens_per_gpu=64, prompt_deadline_s=_WAIT_BOUND_S, sampling=SamplingConfig(n=2),
                                  logprob_role="old_policy", max_lag=0, reference_pool=True,
                                  algorithm=AlgorithmConfig(estimator="dr_grpo"))
    config = BatcherConfig(world_size=1, experience=experience, reorder_window=0,
                           kl_in_reward=LossConfig(kl_coef=0.5, kl_policy_logprobs=policy, kl_in_reward=True))
    return ExperienceBatcher(config, RewardGeneration(lambda p, i: float(i)), OldLogprob(), reference)


@pytest.mark.parametrize("policy, per_sample_kl", [("sampler", 2 * (-1.0 + 1.5)), ("old_policy", 2 * (-1.25 + 1.5))])
def test_reference_pool_fills_ref_beside_old_and_the_kl_takes_the_chosen_policy_side(
        policy: str, per_sample_kl: float) -> None:
    """Rollouts of 2 tokens: sampler -1.0, old policy -1.25, reference -1.5 per token. The KL per
    sample is 1.0 from the sampler's logprobs, 0.5 from the old policy's."""
    async def scenario() -> tuple[list[Sample], dict[str, float]]:
        reference = FrozenReference()
        batcher = _old_policy_batcher(reference, policy)
        await batcher.submit_prompts(0, 0, [_prompt(0)])
        trained, _ = await _drain(batcher, 0, 0)
        assert reference.calls == 1
        return trained, batcher.stats(0)

    trained, stats = asyncio.run(scenario())
    for s in trained:
        assert (s.old_logprobs, s.ref_logprobs) == ([-1.25, -1.25], [-1.5, -1.5])
    assert stats["kl/in_reward_mean"] == pytest.approx(per_sample_kl)
    # rewards 0 and 1, both shifted by the same beta x KL: dr_grpo keeps -0.5 and 0.5
    assert sorted(s.advantage for s in trained) == pytest.approx([-0.5, 0.5])


def test_a_reference_pool_serving_pushed_weights_fails_the_step() -> None:
    async def scenario() -> None:
        batcher = _old_policy_batcher(FrozenReference(version=3), "sampler")
        await batcher.submit_prompts(0, 0, [_prompt(0)])
        await _drain(batcher, 0, 0)

    with pytest.raises(Exception, match="expected one per token from its loaded model"):
        asyncio.run(scenario())


def test_reference_pool_config_errors_name_the_fields() -> None:
    base = dict(max_tokens_per_gpu=8, prompt_deadline_s=1.0, sampling=SamplingConfig())
    with pytest.raises(ValueError, match="reference_pool goes with logprob_role old_policy"):
        BatcherConfig(world_size=1, experience=ExperienceConfig(**base, logprob_role="reference", reference_pool=True))
    with pytest.raises(ValueError, match="kl_policy_logprobs old_policy needs logprob_role old_policy"):
        BatcherConfig(world_size=1, experience=ExperienceConfig(**base, logprob_role="reference"),
                      kl_in_reward=LossConfig(kl_coef=0.1, kl_policy_logprobs="old_policy", kl_in_reward=True))
    BatcherConfig(world_size=1, experience=ExperienceConfig(**base, logprob_role="old_policy", reference_pool=True),
                  kl_in_reward=LossConfig(kl_coef=0.1, kl_policy_logprobs="old_policy", kl_in_reward=True))  # the supported pairing


@pytest.mark.parametrize("kind", ["reference", "teacher"])
def test_frozen_kind_logprob_workers_refuse_pushed_weights(kind: str, tiny_model_dir: Path) -> None:
    from types import SimpleNamespace

    from logprob_worker import LogprobWorker, LogprobWorkerConfig
    from setup_model import load_tokenizer, tokenizer_fingerprint

    worker = LogprobWorker(f"{kind}-worker-0", LogprobWorkerConfig(model_path=str(tiny_model_dir), device="cpu",
                                                                   kind=kind))
    with pytest.raises(ValueError, match=f"frozen {kind} model and never loads pushed weights"):
        asyncio.run(worker.update_weights(SimpleNamespace(version=4, shard_refs=[])))
    assert worker.health().kind == kind and worker.weight_version == -1
    info = worker.model_info()
    assert info["tokenizer_fingerprint"] == tokenizer_fingerprint(load_tokenizer(tiny_model_dir))
    with pytest.raises(ValueError, match="LogprobWorkerConfig.kind"):
        LogprobWorkerConfig(model_path=str(tiny_model_dir), kind="critic")


# ------------------------------------------------------------------------------------------
# 7. On-policy distillation from a teacher pool (issue 14)
# ------------------------------------------------------------------------------------------


def _with_teacher(prompt_id: int, reward: float, student: list[float], teacher: list[float]) -> Sample:
    return Sample(input_token_ids=[1], gt_answer="", prompt_id=prompt_id, output_token_ids=[3] * len(student),
                  sampling_logprobs=student, teacher_logprobs=teacher, reward=reward)


@pytest.mark.parametrize("use_reward", [False, True])
def test_distillation_token_advantages_by_hand(use_reward: bool) -> None:
    """Student logprobs (-1, -2), teacher (-0.5, -3): reverse KL per token 1-... written out:
    log p_s - log p_t = -0.5 and +1.0; advantage per token = base - coef x that, coef 2."""
    a = _with_teacher(0, 1.0, [-1.0, -2.0], [-0.5, -3.0])
    b = _with_teacher(0, 0.0, [-1.0], [-1.0])
    ctx = AlgorithmContext(step=0, config=AlgorithmConfig(estimator="dr_grpo"),
                           distill=DistillConfig(teacher=True, coef=2.0, use_reward=use_reward))
    prepared = builtin_prepare([a, b], ctx)
    base_a, base_b = (0.5, -0.5) if use_reward else (0.0, 0.0)  # dr_grpo on rewards 1, 0
    assert a.token_advantages == pytest.approx([base_a + 1.0, base_a - 2.0])
    assert b.token_advantages == pytest.approx([base_b])
    # per-sample token means of the gap: (-0.5 + 1.0) / 2 = 0.25 and 0; their mean 0.125
    assert prepared.metrics["distill/reverse_kl"] == pytest.approx(0.125)
    assert post_process_batch([a, b]).advantages.tolist() == pytest.approx([base_a + 1.0, base_a - 2.0, base_b])


def test_distillation_group_mean_baseline_by_hand() -> None:
    """baseline group_mean: each group's mean token-mean gap is added back (x coef) to every token
    of its samples. Group 0: gaps (-0.5, +1.0) -> mean 0.25, and (0) -> 0; group mean 0.125.
    Group 1 (one sample, gap +2 on its one token): mean 2, so its token's term is 0."""
    a = _with_teacher(0, 0.0, [-1.0, -2.0], [-0.5, -3.0])
    b = _with_teacher(0, 0.0, [-1.0], [-1.0])
    c = _with_teacher(1, 0.0, [-3.0], [-5.0])
    ctx = AlgorithmContext(step=0, config=AlgorithmConfig(estimator="dr_grpo"),
                           distill=DistillConfig(teacher=True, coef=2.0, use_reward=False, baseline="group_mean"))
    prepared = builtin_prepare([a, b, c], ctx)
    assert a.token_advantages == pytest.approx([2.0 * (0.5 + 0.125), 2.0 * (-1.0 + 0.125)])
    assert b.token_advantages == pytest.approx([2.0 * 0.125])
    assert c.token_advantages == pytest.approx([0.0])
    assert prepared.metrics["distill/reverse_kl"] == pytest.approx((0.25 + 0.0 + 2.0) / 3)  # the baseline is not in it
    with pytest.raises(ValueError, match="DistillConfig.baseline"):
        DistillConfig(teacher=True, baseline="teacher_mean")


class TeacherPool(FrozenReference):
    """Teacher stand-in: -0.75 per token from its loaded model."""

    async def submit(self, method: str, *args: Any, cost: int) -> list[TokenLogprobs]:
        (rollouts,) = args
        self.calls += 1
        return [TokenLogprobs(weight_version=-1, values=[-0.75] * len(r.output_token_ids)) for r in rollouts]


def test_batcher_asks_the_teacher_pool_and_distils() -> None:
    async def scenario() -> tuple[list[Sample], dict[str, float]]:
        teacher = TeacherPool()
        experience = ExperienceConfig(max_tokens_per_gpu=64, prompt_deadline_s=_WAIT_BOUND_S,
                                      sampling=SamplingConfig(n=2), logprob_role="reference", max_lag=0,
                                      distill=DistillConfig(teacher=True, coef=0.5, use_reward=False))
        config = BatcherConfig(world_size=1, experience=experience, reorder_window=0)
        batcher = ExperienceBatcher(config, RewardGeneration(lambda p, i: float(i)), RefLogprob(), teacher=teacher)
        await batcher.submit_prompts(0, 0, [_prompt(0), _prompt(1)])
        trained, _ = await _drain(batcher, 0, 0)
        assert teacher.calls == 2  # one call per group
        return trained, batcher.stats(0)

    trained, stats = asyncio.run(scenario())
    for s in trained:  # sampler -1.0, teacher -0.75: gap -0.25 per token, advantage 0.5 x 0.25 alone
        assert (s.teacher_logprobs, s.ref_logprobs) == ([-0.75, -0.75], [-1.5, -1.5])
        assert s.token_advantages == pytest.approx([0.125, 0.125]) and s.advantage == 0.0
    assert stats["distill/reverse_kl"] == pytest.approx(-0.25)
    assert stats["timing/teacher_s"] >= 0.0


def test_a_teacher_with_another_tokenizer_is_refused_naming_both_models(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    import ray as ray_module

    from async_grpo.trainer.run_inputs import InputError, check_teacher_tokenizer
    from setup_model import load_tokenizer, tokenizer_fingerprint

    other = tmp_path / "other-teacher"
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.add_tokens(["<only-in-the-teacher>"])
    tokenizer.save_pretrained(other)

    class Registry:
        def __init__(self, infos: dict) -> None:
            self.broadcast = SimpleNamespace(remote=lambda method: infos)

    def infos(path: Path) -> dict:
        return {"teacher-worker-0": {"model_path": str(path),
                                     "tokenizer_fingerprint": tokenizer_fingerprint(load_tokenizer(path))}}

    monkeypatch.setattr(ray_module, "get", lambda value, **kw: value)  # the stand-in registry answers directly
    check_teacher_tokenizer(Registry(infos(tiny_model_dir)), str(tiny_model_dir))  # same tokenizer: fine
    with pytest.raises(InputError, match=rf"teacher teacher-worker-0 \({other}\) and the student \({tiny_model_dir}\)"):
        check_teacher_tokenizer(Registry(infos(other)), str(tiny_model_dir))
    with pytest.raises(RuntimeError, match="--mode teacher"):
        check_teacher_tokenizer(Registry({}), str(tiny_model_dir))
