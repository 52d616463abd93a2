"""Reward functions as plug-ins: loading and start-up checks, return validation, weighted
combination, and the verifier pool running them in killable processes (failures score 0 with a
reason and are counted; the pool keeps serving)."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest

from async_grpo.rewards import reward_functions
from async_grpo.config.reward_config import RewardFunctionError, check_function
from async_grpo.rewards.reward_functions import FunctionScore, to_score
from async_grpo.config.reward_config import RewardConfig
from async_grpo.rewards.shaping import combine_scores, counts_as_solved, verdict_agreement
from async_grpo.rewards.math_verify_pool import VerifierPool

PLUGINS = "reward_plugins_for_tests"
DEADLINE_S = 1.0
# Process restarts and queueing on a busy 2-core machine: a stalled pool would never finish at all.
SLACK_S = 30.0


def _call(completion: str, gold: str = "7", token_ids: list[int] | None = None, **record) -> dict:
    return {"prompt": {"gt_answer": gold, **record}, "completion": completion,
            "token_ids": token_ids if token_ids is not None else [1, 2, 3],
            "metadata": {"prompt_id": 4, "group_id": None, "run_id": 0}}


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(num_processes=2, timeout_s=DEADLINE_S) as verifier_pool:
        yield verifier_pool


@pytest.mark.parametrize("value, reward, solved", [
    (1, 1.0, None), (0.25, 0.25, None), (True, 1.0, None),
    ({"a": 0.5, "b": 0.25}, 0.75, None), ({"a": 1.0, "solved": 0}, 1.0, False), ({"solved": 1}, 0.0, True),
])
def test_returns_become_scores(value, reward, solved):
    score = to_score(value)
    assert (score.reward, score.solved, score.failed) == (reward, solved, False)


@pytest.mark.parametrize("value, detail", [
    ("1.0", "str, not a number"), (None, "NoneType"), (float("nan"), "nan"), (math.inf, "inf"),
    ({"a": "x"}, "part 'a'"), ([1.0], "list"),
])
def test_bad_returns_fail_with_the_reason(value, detail):
    score = to_score(value)
    assert score.failed and score.reward == 0.0
    assert score.error.startswith("bad_return:") and detail in score.error


@pytest.mark.parametrize("ref, message", [
    ("no_colon", "must be written 'module:function'"),
    ("module_that_does_not_exist_24:f", "cannot import 'module_that_does_not_exist_24': ModuleNotFoundError"),
    (f"{PLUGINS}:missing", "has no 'missing'"),
    (f"{PLUGINS}:PLUGINS_CONSTANT", "has no"),
    (f"{PLUGINS}:wrong_arity", "cannot be called as f(prompt, completion, token_ids, metadata)"),
])
def test_start_up_check_names_the_problem_in_one_line(ref, message):
    with pytest.raises(RewardFunctionError) as caught:
        check_function(ref)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="RewardConfig.functions"):
        RewardConfig(functions=(ref,))


def test_config_checks_weights_names_and_timeout():
    config = RewardConfig(functions=(f"{PLUGINS}:exact", f"{PLUGINS}:length_parts"), weights=(1.0, 0.5))
    assert config.function_weights() == (1.0, 0.5)
    assert RewardConfig(functions=(f"{PLUGINS}:exact",)).function_weights() == (1.0,)
    with pytest.raises(ValueError, match="RewardConfig.weights has 1 entries for 2"):
        RewardConfig(functions=(f"{PLUGINS}:exact", f"{PLUGINS}:raises"), weights=(1.0,))
    with pytest.raises(ValueError, match="RewardConfig.weights must be finite"):
        RewardConfig(functions=(f"{PLUGINS}:exact",), weights=(math.nan,))
    with pytest.raises(ValueError, match="one function twice"):
        RewardConfig(functions=(f"{PLUGINS}:exact", f"{PLUGINS}:exact"))
    with pytest.raises(ValueError, match="RewardConfig.function_timeout_s"):
        RewardConfig(functions=(f"{PLUGINS}:exact",), function_timeout_s=0)


def test_combination_is_the_weighted_sum_and_solved_needs_every_function():
    scores = [FunctionScore(reward=1.0), FunctionScore(reward=0.5, parts={"x": 0.5}, solved=True)]
    combined = combine_scores(["a", "b"], [2.0, 0.5], scores)
    assert combined.reward == pytest.approx(2.0 * 1.0 + 0.5 * 0.5)
    assert combined.solved and combined.parts == {"a": 1.0, "b": 0.5, "b/x": 0.5} and combined.errors == ()
    failed = combine_scores(["a", "b"], [1.0, 1.0], [FunctionScore(reward=1.0), reward_functions.failure("timeout")])
    assert (failed.reward, failed.solved, failed.errors) == (1.0, False, ("b: timeout",))
    assert not combine_scores(["a"], [1.0], [FunctionScore(reward=0.9)]).solved


def test_a_weight_zero_function_is_a_monitor_outside_the_reward_solved_and_masking():
    # "m" says unsolved and then fails under a masking policy: neither touches the judged verdict.
    combined = combine_scores(["j", "m"], [1.0, 0.0], [FunctionScore(reward=1.0), FunctionScore(reward=0.0)])
    assert (combined.reward, combined.solved, combined.parts) == (1.0, True, {"j": 1.0, "m": 0.0})
    failed = combine_scores(["j", "m"], [1.0, 0.0], [FunctionScore(reward=1.0), reward_functions.failure("timeout")],
                            masking=[True, True])
    assert (failed.solved, failed.masked, failed.failure_reasons) == (True, False, ("m/timeout",))
    weighted = combine_scores(["j", "m"], [1.0, 0.5], [FunctionScore(reward=1.0), FunctionScore(reward=0.0)])
    assert not weighted.solved
    # With the agreement asked for, the two verdicts' agreement is a part of its own (none when one failed).
    compared = combine_scores(["j", "m"], [1.0, 0.0], [FunctionScore(reward=1.0), FunctionScore(reward=0.0)],
                              agreement=("j", "m"))
    assert compared.parts == {"j": 1.0, "m": 0.0, "judge_agreement": 0.0} and compared.reward == 1.0
    assert "judge_agreement" not in combine_scores(
        ["j", "m"], [1.0, 0.0], [FunctionScore(reward=1.0), reward_functions.failure("timeout")], agreement=("j", "m")).parts


@pytest.mark.parametrize("judge, other, agreement", [
    (FunctionScore(reward=1.0), FunctionScore(reward=1.0), 1.0),
    (FunctionScore(reward=0.0), FunctionScore(reward=0.0), 1.0),
    (FunctionScore(reward=1.0), FunctionScore(reward=0.0), 0.0),   # the judge fooled
    (FunctionScore(reward=0.6, solved=False), FunctionScore(reward=1.0), 0.0),
    (reward_functions.failure("timeout"), FunctionScore(reward=1.0), None),
])
def test_the_judges_agreement_compares_the_two_verdicts(judge, other, agreement):
    assert verdict_agreement(["judge", "mv"], [judge, other], "judge", "mv") == agreement
    assert verdict_agreement(["judge"], [judge], "judge", "mv") is None


def test_accuracy_counts_the_verdict_not_the_shaped_reward():
    assert counts_as_solved(True, 0.8)        # correct, unformatted: penalised but solved
    assert not counts_as_solved(False, 1.1)   # wrong, formatted: bonus but unsolved
    assert counts_as_solved(None, 1.0) and not counts_as_solved(None, 0.5)


def test_the_pool_runs_plain_async_batched_and_dict_functions(pool):
    calls = [_call("7"), _call("8"), _call("ok", token_ids=[5])]
    assert [s.reward for s in pool.score_function_sync(f"{PLUGINS}:exact", calls)] == [1.0, 0.0, 0.0]
    assert [s.reward for s in pool.score_function_sync(f"{PLUGINS}:async_exact", calls)] == [1.0, 0.0, 0.0]
    assert [s.reward for s in pool.score_function_sync(f"{PLUGINS}:batch_rank", calls)] == [0.0, 1.0, 2.0]
    parts = pool.score_function_sync(f"{PLUGINS}:length_parts", calls)[2]
    assert (parts.reward, parts.parts, parts.solved) == (1.02, {"tokens": 1.0, "chars": 0.02}, True)
    (record,) = pool.score_function_sync(f"{PLUGINS}:reads_record", [_call("x", extra={"bonus": 0.5})])
    assert record.reward == 4.5


def test_math_verify_is_one_such_function(pool):
    calls = [_call("so \\boxed{7}"), _call("\\boxed{\\frac{14}{2}}"), _call("\\boxed{8}")]
    scores = pool.score_function_sync("async_grpo.rewards.math_verifier:math_verify_reward", calls)
    assert [s.reward for s in scores] == [1.0, 1.0, 0.0]
    assert scores == [s for s in scores if not s.failed]


@pytest.mark.parametrize("name, kind, counter", [
    ("raises", "raised: RuntimeError: boom", "function_raised"),
    ("hangs", "timeout", "function_timeouts"),
    ("returns_text", "bad_return: the return value is a str", "function_bad_returns"),
    ("returns_nan", "bad_return: the return value is nan", "function_bad_returns"),
    ("exits", "crash: verifier process died", "function_crashes"),
    ("batch_too_short", "bad_return: batched function returned 1 results for 2", "function_bad_returns"),
])
@pytest.mark.system
def test_a_misbehaving_function_scores_zero_with_its_reason_and_the_pool_serves_on(pool, name, kind, counter):
    before = pool.stats()
    start = time.monotonic()
    scores = pool.score_function_sync(f"{PLUGINS}:{name}", [_call("7"), _call("7")])
    assert time.monotonic() - start < 2 * DEADLINE_S + SLACK_S
    assert [(s.reward, s.failed) for s in scores] == [(0.0, True)] * 2
    assert all(s.error.startswith(kind) for s in scores), scores
    after = pool.stats()
    assert after[counter] - before[counter] == 2
    assert after["function_failed"] - before["function_failed"] == 2
    # The pool still answers, math-verify included.
    assert [s.reward for s in pool.score_function_sync(f"{PLUGINS}:exact", [_call("7")])] == [1.0]
    assert pool.score_sync(["\\boxed{7}"], "7")[0].reward == 1.0


@pytest.mark.system
def test_hostile_samples_cost_their_deadline_and_spare_the_others(pool):
    calls = [_call("hang"), _call("fine"), _call("raise"), _call("fine")]
    scores = pool.score_function_sync(f"{PLUGINS}:hostile_by_text", calls)
    assert [(s.reward, s.error.split(":")[0]) for s in scores] == [(0.0, "timeout"), (1.0, ""), (0.0, "raised"),
                                                                   (1.0, "")]


@pytest.mark.system
def test_a_per_call_deadline_overrides_the_pools(pool):
    start = time.monotonic()
    (score,) = pool.score_function_sync(f"{PLUGINS}:hangs", [_call("7")], timeout_s=0.2)
    assert score.error == "timeout"
    assert time.monotonic() - start < DEADLINE_S + SLACK_S


def _fake_completion(index: int, text: str, finish_reason: str = "stop"):
    """What the generation worker reads of a vLLM CompletionOutput; one token per character."""
    from types import SimpleNamespace

    tokens = [ord(c) for c in text]
    return SimpleNamespace(index=index, text=text, token_ids=tokens, finish_reason=finish_reason,
                           logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in tokens])


def _generate(pool, texts: list[str], reward: RewardConfig, record: dict | None = None, finishes=None):
    """GenerationWorker.generate on fixed completions (no engine), scored by the real pool."""
    import asyncio

    from async_grpo.config.sampling import SamplingConfig
    from sample_processing_utils import Sample
    from vllm_worker import GenerationWorker, GenerationWorkerConfig

    finishes = finishes or ["stop"] * len(texts)
    worker = GenerationWorker("unit", GenerationWorkerConfig(model_path="unused"), verifier=pool)

    async def fake_engine(sample, sampling, adapter=None):
        return [_fake_completion(i, text, finish) for i, (text, finish) in enumerate(zip(texts, finishes))]

    worker._run_engine = fake_engine
    prompt = Sample(input_token_ids=[1], gt_answer="7", prompt_id=3, record=record)
    return asyncio.run(worker.generate(prompt, SamplingConfig(n=len(texts), reward=reward)))


def test_the_worker_combines_weighted_functions_and_sets_solved_and_parts(pool):
    reward = RewardConfig(functions=(f"{PLUGINS}:exact", f"{PLUGINS}:reads_record"), weights=(1.0, 0.5),
                          format_pattern="^7", format_bonus=0.25)
    samples = _generate(pool, ["7", "8", "x7"], reward, record={"prompt": "3+4=", "extra": {"bonus": -3}})
    # exact: 1, 0, 0; reads_record: bonus -3 + prompt_id 3 = 0 each; format bonus to "7" only.
    assert [s.reward for s in samples] == [1.25, 0.0, 0.0]
    # reads_record's reward is 0 (< 1), so no completion is solved by *every* function.
    assert [s.solved for s in samples] == [False, False, False]
    assert samples[0].reward_parts == {"exact": 1.0, "reads_record": 0.0}
    assert all(s.record is None for s in samples), "the record is dropped once scored"


def test_a_failing_function_flags_the_sample_and_the_others_still_count(pool):
    reward = RewardConfig(functions=(f"{PLUGINS}:exact", f"{PLUGINS}:hostile_by_text"))
    samples = _generate(pool, ["7", "raise"], reward)
    assert [(s.reward, s.reward_failed, s.solved) for s in samples] == [(2.0, False, True), (0.0, True, False)]
    assert samples[1].reward_parts == {"exact": 0.0, "hostile_by_text": 0.0}


def test_under_math_verify_accuracy_counts_the_verdict_not_the_format_shaping(pool):
    reward = RewardConfig(format_pattern=r"\\boxed\{.+\}", format_bonus=0.5, format_penalty=0.25)
    samples = _generate(pool, ["\\boxed{7}", "7", "\\boxed{8}", "\\boxed{7"], reward,
                        finishes=["stop", "stop", "stop", "length"])
    assert [s.reward for s in samples] == [1.5, 0.75, 0.5, 0.0]
    # The correct unformatted answer (0.75) is solved; the formatted wrong one (0.5) is not; the
    # truncated one got truncated_reward unverified: unsolved.
    assert [s.solved for s in samples] == [True, True, False, False]
    assert [counts_as_solved(s.solved, s.reward) for s in samples] == [True, True, False, False]


def test_an_overlong_completion_is_rejected_before_any_process(pool):
    huge = "x" * (pool.limits.max_completion_chars + 1)
    before = pool.stats()["function_rejected"]
    scores = pool.score_function_sync(f"{PLUGINS}:batch_rank", [_call("a"), _call(huge), _call("b")])
    assert [(s.reward, s.failed) for s in scores] == [(0.0, False), (0.0, True), (1.0, False)]
    assert scores[1].error.startswith("rejected: completion length")
    assert pool.stats()["function_rejected"] - before == 1


def test_the_worker_routes_a_prompt_by_its_data_source(pool):
    reward = RewardConfig(functions=(f"{PLUGINS}:exact",), by_data_source=(f"lengths={PLUGINS}:length_parts",))
    routed = _generate(pool, ["ok"], reward, record={"data_source": "lengths"})
    assert routed[0].reward_parts == {"length_parts": 2.02, "length_parts/tokens": 2.0, "length_parts/chars": 0.02}
    assert routed[0].solved is True
    default = _generate(pool, ["7"], reward, record={"data_source": "elsewhere"})
    assert default[0].reward_parts == {"exact": 1.0}


def test_a_slow_import_does_not_count_against_the_deadline(pool):
    # The deadline is 1 s; importing the module takes 2 s, in the process, before the first call.
    scores = pool.score_function_sync("slow_import_plugin_for_tests:score", [_call("a"), _call("b")])
    assert [(s.reward, s.failed) for s in scores] == [(1.0, False), (1.0, False)]


class _WorkerGeneration:
    """The batcher's generation client, served by a real GenerationWorker (fixed completions per
    prompt, no engine) scored by the real pool: what reaches the step metrics from a worker."""

    def __init__(self, pool, texts_of: dict[int, list[str]], reward: RewardConfig) -> None:
        self.pool, self.texts_of, self.reward = pool, texts_of, reward

    async def submit(self, method: str, *args, cost: int):
        from vllm_worker import GenerationWorker, GenerationWorkerConfig

        prompt, sampling = args
        texts = self.texts_of[prompt.prompt_id]
        worker = GenerationWorker("unit", GenerationWorkerConfig(model_path="unused"), verifier=self.pool)

        async def fake_engine(sample, sampling, adapter=None):
            return [_fake_completion(i, text) for i, text in enumerate(texts)]

        worker._run_engine = fake_engine
        worker.served.version = 0  # step 0's weights under max_lag 0: the rollouts are fresh
        return await worker.generate(prompt, dataclasses.replace(sampling, reward=self.reward))


def _step_metrics(pool, texts_of: dict[int, list[str]], reward: RewardConfig) -> dict[str, float]:
    """One batcher step over prompts texts_of's keys (n = 4 completions each); its metrics."""
    import asyncio

    from async_grpo.batching.batcher_config import BatcherConfig, ExperienceConfig
    from async_grpo.config.sampling import SamplingConfig
    from sample_processing_utils import Sample
    from vllm_experience_batcher import EndOfStep, ExperienceBatcher

    experience = ExperienceConfig(max_tokens_per_gpu=64, prompt_deadline_s=120.0, sampling=SamplingConfig(n=4),
                                  logprob_role="none", max_lag=0)
    config = BatcherConfig(world_size=1, experience=experience, reorder_window=0)

    async def scenario() -> dict[str, float]:
        batcher = ExperienceBatcher(config, _WorkerGeneration(pool, texts_of, reward), None)
        await batcher.submit_prompts(0, 0, [Sample(input_token_ids=[1], gt_answer="7", prompt_id=i)
                                            for i in texts_of])
        while not isinstance(await asyncio.wait_for(batcher.next_message(0, 0), 120.0), EndOfStep):
            pass
        return batcher.stats(0)

    return asyncio.run(scenario())


@pytest.mark.system
def test_each_failure_reason_of_a_function_is_counted_in_the_step_metrics(pool):
    name = "fails_as_told"
    reward = RewardConfig(functions=(f"{PLUGINS}:{name}", f"{PLUGINS}:exact"))
    metrics = _step_metrics(pool, {0: ["raise", "hang", "nan", "7"], 1: ["text", "exit", "raise", "8"]}, reward)
    failed = {key: value for key, value in metrics.items() if key.startswith("counts/reward_failures/")}
    assert failed == {f"counts/reward_failures/{name}/raised": 2.0, f"counts/reward_failures/{name}/timeout": 1.0,
                      f"counts/reward_failures/{name}/bad_return": 2.0, f"counts/reward_failures/{name}/crash": 1.0}
    assert metrics["counts/reward_failures"] == 6.0
    # The failing samples still got `exact`'s reward: "7" x 1 of 8; fails_as_told gave 1 to "7" and "8".
    assert metrics[f"reward/{name}"] == pytest.approx(2 / 8) and metrics["reward/exact"] == pytest.approx(1 / 8)


def test_math_verify_failures_are_counted_by_reason_in_the_step_metrics(pool):
    metrics = _step_metrics(pool, {0: ["\\boxed{5^{5^{5^{5^5}}}}", "\\boxed{7}", "{" * 50, "8"]}, RewardConfig())
    assert metrics["counts/reward_failures/math_verify/rejected"] == 2.0
    assert metrics["counts/reward_failures"] == 2.0
    clean = _step_metrics(pool, {0: ["7", "\\boxed{7}", "8", "9"]}, RewardConfig())
    assert clean["counts/reward_failures"] == 0.0
    assert not [key for key in clean if key.startswith("counts/reward_failures/")]
