"""evaluation.py: pass@k against a brute-force reference, the config, the Evaluator's requests and
maths with a scripted client, and one run through a real generation worker and registry in Ray.

    .venv/bin/python -m pytest tests/trainer/test_evaluation.py -q
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from async_grpo.demo_assets.arithmetic_data import write_arithmetic_table
from async_grpo.data.dataset import DatasetConfig, DatasetError
from async_grpo.config.judge_config import JudgeConfig
from async_grpo.config.reward_config import RewardConfig
from async_grpo.config.sampling import SamplingConfig
from async_grpo.trainer.evaluation import (
    EvalConfig, EvalDataConfig, EvaluationError, Evaluator, evaluation_metrics, load_eval_prompts, pass_at_k,
)
from sample_processing_utils import Sample

# The training sampling the evaluator derives its requests from: its reward policy for truncated
# completions (-0.5, to tell it from a wrong answer) and max_tokens carry over.
TRAIN_SAMPLING = SamplingConfig(n=16, temperature=1.0, max_tokens=4, seed=5, truncated_reward=-0.5)
# Bound on any wait in the scripted-client tests: a guard against hangs, not a timing threshold.
HANG_GUARD_S = 30.0
# Weight version the scripted client reports serving.
SERVED_VERSION = 3


def _prompt(prompt_id: int, gt_answer: str) -> Sample:
    return Sample(input_token_ids=[10 + prompt_id, 11], gt_answer=gt_answer, prompt_id=prompt_id)


class ScriptedClient:
    """Test double for the generation registry (the batcher's RequestClient protocol).

    Completes each prompt with scripted texts (one token per character) and scores them as the
    worker does for these cases: truncated (len >= max_tokens) -> truncated_reward, else 1.0 when
    the text equals the gold answer, 0.0 otherwise. With `expected_calls` every call waits until
    that many calls are in flight, which proves they were all sent at once.
    """

    def __init__(self, script: dict[int, tuple[str, list[str]]], expected_calls: int = 0,
                 fail: tuple[int, str] | None = None, hang: bool = False, greedy_group_size: int = 1) -> None:
        self.script = script
        self.expected_calls = expected_calls
        self.fail = fail
        self.hang = hang
        self.greedy_group_size = greedy_group_size
        self.calls: list[tuple[str, int, SamplingConfig, int]] = []
        self.cancelled = 0
        self._all_in = asyncio.Event()

    async def submit(self, method: str, *args: Any, cost: int) -> list[Sample]:
        sample, sampling = args
        kind = "greedy" if sampling.temperature == 0 else "sampled"
        self.calls.append((method, sample.prompt_id, sampling, cost))
        if len(self.calls) == self.expected_calls:
            self._all_in.set()
        try:
            if self.expected_calls:
                await self._all_in.wait()
            if self.fail == (sample.prompt_id, kind):
                raise RuntimeError("worker exploded")
            if self.hang or self.fail is not None:
                await asyncio.Event().wait()  # held until cancelled
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        greedy, sampled = self.script[sample.prompt_id]
        texts = [greedy] * self.greedy_group_size if kind == "greedy" else sampled[: sampling.n]
        return [self._completed(sample, text, sampling) for text in texts]

    @staticmethod
    def _completed(sample: Sample, text: str, sampling: SamplingConfig) -> Sample:
        truncated = len(text) >= sampling.max_tokens
        reward = sampling.truncated_reward if truncated else float(text == sample.gt_answer)
        return replace(sample, output_token_ids=[20] * len(text), output_text=text, truncated=truncated,
                       finish_reason="length" if truncated else "stop", reward=reward, weight_version=SERVED_VERSION)


# Three prompts, pass@2 from 4 samples each (max_tokens 4: "9999" is cut off).
SCRIPT = {
    0: ("7", ["7", "3", "7", "1"]),  # greedy right; 2 of 4 samples right
    1: ("4", ["5", "0", "0", "0"]),  # greedy wrong; 1 of 4
    2: ("9999", ["8", "8", "0", "1"]),  # greedy truncated; 0 of 4
}
GOLD = {0: "7", 1: "5", 2: "9"}


def _prompts() -> list[Sample]:
    return [_prompt(i, GOLD[i]) for i in sorted(GOLD)]


def _brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Share of the k-subsets of n samples (c of them correct) holding a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    return sum(any(s) for s in subsets) / len(subsets)


# ---------------------------------------------------------------- pass@k


def test_pass_at_k_hand_computed_values() -> None:
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # pass@1 is c / n
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 1, 5) == pytest.approx(1 - 126 / 252)  # 1 - C(9,5)/C(10,5) = 0.5
    assert pass_at_k(4, 3, 2) == 1.0  # fewer than k wrong samples: every pair holds a right one
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 4, 4) == 1.0


def test_pass_at_k_matches_brute_force() -> None:
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_stays_exact_for_large_n() -> None:
    # 1 - C(150, 100) / C(200, 100): the ratio is ~1e-31, far below float resolution of 1.
    assert pass_at_k(200, 50, 100) == 1.0
    assert pass_at_k(1000, 1, 1) == pytest.approx(1e-3, rel=1e-12)


@pytest.mark.parametrize(("n", "c", "k", "problem"), [
    (4, 1, 5, "k must be in [1, n=4]"),
    (4, 1, 0, "k must be in [1, n=4]"),
    (4, 5, 2, "c must be in [0, n=4]"),
    (4, -1, 2, "c must be in [0, n=4]"),
    (0, 0, 1, "n must be >= 1"),
])
def test_pass_at_k_rejects_impossible_counts(n: int, c: int, k: int, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        pass_at_k(n, c, k)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"every": -1}, "EvalConfig.every"),
    ({"every": 5}, "EvalConfig.data.path"),
    ({"pass_k": -1}, "EvalConfig.pass_k"),
    ({"num_samples": 4}, "EvalConfig.num_samples=4 needs pass_k"),
    ({"pass_k": 4, "num_samples": 3}, "EvalConfig.num_samples must be >= pass_k"),
    ({"temperature": 0.0}, "EvalConfig.temperature"),
    ({"temperature": float("inf")}, "EvalConfig.temperature"),
    ({"top_p": 0.0}, "EvalConfig.top_p"),
    ({"seed": -1}, "EvalConfig.seed"),
    ({"max_tokens": 0}, "EvalConfig.max_tokens"),
    ({"max_prompts": 0}, "EvalConfig.max_prompts"),
    ({"timeout_s": 0.0}, "EvalConfig.timeout_s"),
])
def test_eval_config_rejects_bad_values_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        EvalConfig(**kwargs)


def test_eval_data_config_rejects_a_bad_prompt_limit() -> None:
    with pytest.raises(ValueError, match=re.escape("EvalDataConfig.max_prompt_tokens")):
        EvalDataConfig(path="e.jsonl", max_prompt_tokens=0)


def test_eval_config_defaults_are_off_and_schedule_includes_the_last_step() -> None:
    assert not EvalConfig().enabled
    assert not any(EvalConfig().is_due(step, 10) for step in range(10))
    config = EvalConfig(every=3, data=EvalDataConfig(path="e.jsonl"))
    assert [step for step in range(10) if config.is_due(step, 10)] == [2, 5, 8, 9]
    assert EvalConfig(pass_k=4).samples_per_prompt == 4
    assert EvalConfig(pass_k=4, num_samples=16).samples_per_prompt == 16
    assert EvalConfig().samples_per_prompt == 0


def test_eval_config_loads_from_flags() -> None:
    from async_grpo.config.run_config import load_config

    config = load_config(EvalConfig, ["--data.path", "eval.jsonl", "--every", "50", "--pass_k", "4",
                                      "--num_samples", "8", "--max_tokens", "none"])
    assert config == EvalConfig(data=EvalDataConfig(path="eval.jsonl"), every=50, pass_k=4, num_samples=8)


# ---------------------------------------------------------------- loading


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from setup_model import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def test_eval_prompts_load_like_training_data_and_are_capped(tmp_path: Path, tokenizer) -> None:
    path = write_arithmetic_table(tmp_path / "eval.jsonl")
    train = DatasetConfig(path="train.jsonl", max_prompt_tokens=16)
    config = EvalConfig(every=1, data=EvalDataConfig(path=str(path)), max_prompts=10)
    prompts = load_eval_prompts(config, train, tokenizer)
    assert [p.prompt_id for p in prompts] == list(range(10))
    assert [tokenizer.decode(p.input_token_ids) for p in prompts[:2]] == ["0+0=", "0+1="]
    assert [p.gt_answer for p in prompts] == [str(b) for b in range(10)]
    assert len(load_eval_prompts(replace(config, max_prompts=None), train, tokenizer)) == 100
    # The eval set's own max_prompt_tokens overrides the training data's; errors name file:line.
    short = replace(config, data=EvalDataConfig(path=str(path), max_prompt_tokens=3))
    with pytest.raises(DatasetError, match=re.escape(f"{path}:1: prompt has 4 tokens, more than max_prompt_tokens=3")):
        load_eval_prompts(short, train, tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "gt_answer": "2"}\n{"prompt": "1+2="}\n')
    with pytest.raises(DatasetError, match=re.escape(f"{bad}:2: missing field 'gt_answer'")):
        Evaluator.load(replace(config, data=EvalDataConfig(path=str(bad))), train, TRAIN_SAMPLING, tokenizer)


# ---------------------------------------------------------------- Evaluator with a scripted client


def test_evaluator_sends_greedy_and_sampled_requests_at_once_and_computes_metrics_by_hand() -> None:
    config = EvalConfig(pass_k=2, num_samples=4, temperature=0.7, top_p=0.9, seed=42)
    client = ScriptedClient(SCRIPT, expected_calls=2 * len(SCRIPT))
    result = Evaluator(config, _prompts(), TRAIN_SAMPLING).run(client)

    greedy = SamplingConfig(n=1, temperature=0.0, top_p=1.0, max_tokens=4, seed=None, truncated_reward=-0.5)
    sampled = SamplingConfig(n=4, temperature=0.7, top_p=0.9, max_tokens=4, seed=42, truncated_reward=-0.5)
    expected_calls = {("generate", i, greedy, 1) for i in GOLD} | {("generate", i, sampled, 4) for i in GOLD}
    assert len(client.calls) == 6 and set(client.calls) == expected_calls

    metrics = result.metrics()
    # pass@2 per prompt: 1 - C(2,2)/C(4,2) = 5/6, 1 - C(3,2)/C(4,2) = 1/2, 0.
    assert metrics.pop("eval/pass@2") == pytest.approx((5 / 6 + 1 / 2 + 0) / 3)
    assert metrics.pop("eval/time_s") == result.time_s > 0
    assert metrics == pytest.approx({
        "eval/accuracy": 1 / 3,
        "eval/reward_mean": (1.0 + 0.0 - 0.5) / 3,  # the truncated greedy answer earns truncated_reward
        "eval/num_prompts": 3.0,
        "eval/mean_response_tokens": (1 + 1 + 4) / 3,
        "eval/truncated_frac": 1 / 3,
        "eval/reward_failures": 0.0,
        "eval/weight_version": float(SERVED_VERSION),
        "eval/sampled_accuracy": 3 / 12,
    })
    assert [p.prompt.prompt_id for p in result.prompts] == [0, 1, 2]
    assert [p.greedy.output_text for p in result.prompts] == ["7", "4", "9999"]
    assert [len(p.sampled) for p in result.prompts] == [4, 4, 4]


def test_greedy_only_evaluation_sends_one_request_per_prompt() -> None:
    client = ScriptedClient(SCRIPT)
    config = EvalConfig(max_tokens=8)
    metrics = Evaluator(config, _prompts(), TRAIN_SAMPLING).run(client).metrics()
    assert [(call[2].n, call[2].temperature, call[2].max_tokens, call[3]) for call in client.calls] == [(1, 0.0, 8, 1)] * 3
    assert not any(key.startswith("eval/pass@") for key in metrics) and "eval/sampled_accuracy" not in metrics
    assert metrics["eval/accuracy"] == pytest.approx(1 / 3) and metrics["eval/truncated_frac"] == 0.0


def test_evaluation_metrics_count_reward_failures_and_the_oldest_version() -> None:
    result = Evaluator(EvalConfig(pass_k=1), _prompts(), TRAIN_SAMPLING).run(ScriptedClient(SCRIPT))
    result.prompts[1].sampled[0].reward_failed = True
    result.prompts[2].greedy.weight_version = SERVED_VERSION - 1
    metrics = evaluation_metrics(result.prompts, pass_k=1, time_s=1.0)
    assert metrics["eval/reward_failures"] == 1.0 and metrics["eval/weight_version"] == SERVED_VERSION - 1
    assert metrics["eval/pass@1"] == pytest.approx((1 + 1 + 0) / 3)  # first samples: "7", "5", "8"


def test_a_failed_request_fails_the_evaluation_naming_the_prompt_and_cancels_the_rest() -> None:
    client = ScriptedClient(SCRIPT, expected_calls=6, fail=(1, "sampled"))
    evaluator = Evaluator(EvalConfig(pass_k=2, num_samples=4), _prompts(), TRAIN_SAMPLING)
    with pytest.raises(EvaluationError, match=re.escape("eval prompt_id=1 (sampled): RuntimeError: worker exploded")):
        asyncio.run(asyncio.wait_for(evaluator.evaluate(client), HANG_GUARD_S))
    assert client.cancelled == 5  # every other request was stopped, none left running


def test_an_evaluation_past_its_timeout_fails_and_cancels_its_requests() -> None:
    client = ScriptedClient(SCRIPT, hang=True)
    evaluator = Evaluator(EvalConfig(pass_k=2, timeout_s=0.2), _prompts(), TRAIN_SAMPLING)
    with pytest.raises(EvaluationError, match=re.escape("did not finish within EvalConfig.timeout_s=0.2 s")):
        asyncio.run(asyncio.wait_for(evaluator.evaluate(client), HANG_GUARD_S))
    assert client.cancelled == 6


def test_a_wrong_group_size_is_an_error() -> None:
    client = ScriptedClient(SCRIPT, greedy_group_size=2)
    with pytest.raises(EvaluationError, match="generate returned 2 completions, asked for 1"):
        Evaluator(EvalConfig(), _prompts(), TRAIN_SAMPLING).run(client)


def test_evaluator_needs_prompts() -> None:
    with pytest.raises(ValueError, match="at least one prompt"):
        Evaluator(EvalConfig(), [], TRAIN_SAMPLING)


# ---------------------------------------------------------------- real worker and registry (Ray)


@pytest.mark.vllm
def test_evaluator_through_a_real_registry_and_worker(ray_local, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The answering model (support.generation_worker) answers '7', '3', ' ' or nothing, one token per
    step, whatever the prompt; with max_tokens 1 its greedy answer is '7', so exactly the prompts
    whose gold is 7 are solved greedily, and sampled answers vary."""
    # The answering model and the worker settings of the generation-worker tests, reused as is.
    from async_grpo.config.actor_names import GENERATION, RAY_NAMESPACE
    from async_grpo.launch.ray_env import actor_runtime_env
    from setup_model import load_tokenizer
    from support.generation_worker import expected_reward, worker_config, write_answering_model
    from vllm_experience_batcher import RayRegistryClient
    from vllm_registry import RegistryConfig, get_or_create_registry
    from vllm_worker import GenerationWorkerActor

    model_dir = write_answering_model(tiny_model_dir, tmp_path / "answering")
    gold = ["7", "3", "7", "3", "7", "3"]
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "gt_answer": g}) + "\n" for i, g in enumerate(gold)))
    sampling = SamplingConfig(n=8, max_tokens=4, truncated_reward=None)  # verify cut-off answers too
    config = EvalConfig(every=1, data=EvalDataConfig(path=str(path)), pass_k=2, num_samples=6, seed=11, max_tokens=1)
    evaluator = Evaluator.load(config, DatasetConfig(path="train.jsonl", max_prompt_tokens=16), sampling,
                               load_tokenizer(model_dir))

    ray = ray_local
    name = "generation-worker-eval-test"
    worker = GenerationWorkerActor.options(
        name=name, namespace=RAY_NAMESPACE, runtime_env=actor_runtime_env()
    ).remote(name, worker_config(model_dir))
    registry = get_or_create_registry(GENERATION, RegistryConfig(no_worker_timeout_s=30.0))
    try:
        ray.get(worker.start.remote())
        ray.get(registry.register.remote(name))
        client = RayRegistryClient(registry)
        first, second = evaluator.run(client), evaluator.run(client)
        served = sum(row.requests_served for row in ray.get(registry.status.remote()))
    finally:
        ray.kill(registry)
        ray.get(worker.shutdown.remote())
        ray.kill(worker)

    assert served == 2 * 2 * len(gold)  # greedy + sampled per prompt, twice, all through the registry
    texts: set[str] = set()
    for evaluation, gt in zip(first.prompts, gold):
        completions = [evaluation.greedy, *evaluation.sampled]
        assert len(evaluation.sampled) == 6 and evaluation.greedy.output_text == "7" and evaluation.greedy.truncated
        assert all(c.reward == expected_reward(c.output_text, gt) and c.weight_version == -1 for c in completions)
        texts.update(c.output_text for c in evaluation.sampled)
    assert len(texts) > 1  # the samples differ, so pass@2 is not trivially 0 or 1

    metrics = first.metrics()
    correct = [[c.reward >= 1.0 for c in p.sampled] for p in first.prompts]
    assert metrics["eval/accuracy"] == 0.5  # the three gold-7 prompts
    assert metrics["eval/pass@2"] == pytest.approx(
        sum(_brute_force_pass_at_k(6, sum(c), 2) for c in correct) / len(gold), abs=1e-12)
    assert metrics["eval/sampled_accuracy"] == pytest.approx(sum(map(sum, correct)) / (6 * len(gold)))
    assert (metrics["eval/num_prompts"], metrics["eval/mean_response_tokens"], metrics["eval/truncated_frac"]) == (6, 1, 1)
    assert math.isfinite(metrics["eval/time_s"]) and metrics["eval/time_s"] > 0

    # Seeded per prompt: a second evaluation of the same weights samples the same completions.
    for a, b in zip(first.prompts, second.prompts):
        assert [s.output_token_ids for s in a.sampled] == [s.output_token_ids for s in b.sampled]
        assert a.greedy.output_token_ids == b.greedy.output_token_ids
    assert {k: v for k, v in second.metrics().items() if k != "eval/time_s"} == {
        k: v for k, v in metrics.items() if k != "eval/time_s"}


def test_eval_reward_math_verify_scores_apart_from_the_training_functions() -> None:
    judged = replace(TRAIN_SAMPLING, reward=RewardConfig(
        functions=("judge", "async_grpo.rewards.math_verifier:math_verify_reward"), weights=(1.0, 0.0),
        judge=JudgeConfig(agree_with="math_verify_reward")))
    assert Evaluator(EvalConfig(), _prompts(), judged).greedy_sampling.reward == judged.reward
    evaluator = Evaluator(EvalConfig(pass_k=2, reward="math_verify"), _prompts(), judged)
    for sampling in (evaluator.greedy_sampling, evaluator.sampled_sampling):
        assert sampling.reward.functions == () and not sampling.reward.uses_judge
    assert evaluator.greedy_sampling.truncated_reward == TRAIN_SAMPLING.truncated_reward
    with pytest.raises(ValueError, match="EvalConfig.reward must be one of"):
        EvalConfig(reward="judge")
