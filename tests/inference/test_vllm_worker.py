"""Generation worker: reward policy (truncation, format shaping, overlong punishment), stop
strings, stop token ids and EOS, and a real vLLM engine inside Ray on the tiny model.

    .venv/bin/python -m pytest tests/inference/test_vllm_worker.py -x -q

The engine tests share one engine (module scope, ~35 s to start on CPU) serving the tiny model
rewired into an answer sampler, so rewards vary; the tied-embedding test starts a second engine
on the tied tiny model. Rewards are re-derived with math-verify itself (support.generation_worker),
logprobs with the HF model (support.reference_logprobs).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from async_grpo.config.worker_options import EngineConfig, VerificationConfig
from async_grpo.inference.engine_process import engine_process_env
from async_grpo.inference.failed_samples import FailedSampleLog
from async_grpo.inference.served_adapters import AdapterBook
from async_grpo.rewards.math_verifier import RewardResult
from async_grpo.rewards.reward_failure import FailureKind
from async_grpo.config.reward_config import RewardConfig
from async_grpo.config.sampling import SamplingConfig
from async_grpo.weights.update import WeightUpdate, state_dict_to_blobs
from async_grpo.weights.worker_bucket_files import reload_buckets
from async_grpo.weights.worker_reload_fixes import with_tied_lm_head
from sample_processing_utils import Sample
from setup_model import load_tokenizer
from support.generation_worker import (
    engine_core_processes, expected_reward, perturbed_copy, worker_config, write_answering_model,
)
from support.reference_logprobs import reference_logprobs
from vllm_worker import GenerationWorker, GenerationWorkerActor, GenerationWorkerConfig

logger = logging.getLogger(__name__)

# Upper bound on a scoring call in the hostile test: a guard so a hung verifier fails the test
# instead of hanging it, far above the verifier's own deadline (not a performance threshold).
HANG_GUARD_S = 120.0
# float32 engine vs float32 HF on the same tokens: observed max |diff| ~3e-6 (different kernels
# and summation order); 1e-4 leaves room for that and is far below the perturbation's effect.
LOGPROB_ATOL = 1e-4
# A weight perturbation (support.generation_worker.PERTURBATION_SCALE) moves logprobs of the tiny
# model by ~1 nat; requiring a 0.1 gap proves the engine serves the new weights and not the old ones.
MIN_OLD_NEW_GAP = 0.1
EXPONENT_TOWER = "The answer is $\\boxed{5^{5^{5^{5^{5^{5^{5}}}}}}}$"
# Seed of the stop tests' requests: the same seed with and without a stop samples the same tokens
# up to the stop (the answering model's logits do not depend on the context), and this one gives
# completions with and without each stop (checked in the test).
STOP_TEST_SEED = 4321
# A format the answering model meets about a third of the time: the completion starts with "7".
STARTS_WITH_SEVEN = RewardConfig(format_pattern=r"^7", format_bonus=0.5, format_penalty=0.25)


# The tiny model's whole context, and prompts long enough that three of them overflow one step.
_LONG_MODEL_LEN = 1024
_LONG_PROMPT_TOKENS = 700


def _build_sample(text: str, gt_answer: str, prompt_id: int, tokenizer) -> Sample:
    return Sample(input_token_ids=tokenizer.encode(text), gt_answer=gt_answer, prompt_id=prompt_id)


def _greedy(ray, actor, sample: Sample) -> Sample:
    (rollout,) = ray.get(actor.generate.remote(sample, SamplingConfig(n=1, temperature=0.0, max_tokens=24)))
    return rollout


def _max_diff(vllm_logprobs: list[float], hf_logprobs: torch.Tensor) -> float:
    return float((torch.tensor(vllm_logprobs) - hf_logprobs).abs().max())


def _start_actor(ray, name: str, config: GenerationWorkerConfig):
    actor = GenerationWorkerActor.options(name=name).remote(name, config)
    began = time.perf_counter()
    ray.get(actor.start.remote())  # engine up and self-check passed: INIT
    logger.warning("engine %s started in %.1f s", name, time.perf_counter() - began)
    assert ray.get(actor.health.remote()).state == "INIT"
    ray.get(actor.mark_ready.remote())  # what registration does once the worker holds the latest weights
    assert ray.get(actor.health.remote()).state == "READY"
    return actor


def _stop_actor(ray, actor) -> None:
    ray.get(actor.shutdown.remote())
    ray.kill(actor)


# ---------------------------------------------------------------- pure logic, no engine


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": 0.0, "n": 4}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"max_resample_rounds": -1}, "max_resample_rounds"),
        ({"overlong_buffer": 7, "max_tokens": 6}, "overlong_buffer"),
        ({"overlong_penalty": -1.0}, "overlong_penalty"),
        ({"truncated_reward": float("nan")}, "truncated_reward"),
    ],
)
def test_sampling_config_rejects_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"SamplingConfig.{field}"):
        SamplingConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"model_path": ""}, "GenerationWorkerConfig.model_path"),
        ({"weight_update_pause_mode": "abort"}, "GenerationWorkerConfig.weight_update_pause_mode"),
        ({"verification": {"verifier_timeout_s": 0.0}}, "VerificationConfig.verifier_timeout_s"),
    ],
)
def test_worker_config_rejects_bad_values(kwargs: dict, field: str) -> None:
    sections = {"verification": VerificationConfig}
    with pytest.raises(ValueError, match=field):
        GenerationWorkerConfig(**{"model_path": "m", **{k: sections[k](**v) if k in sections else v
                                                        for k, v in kwargs.items()}})


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes"),
    ],
)
def test_engine_config_rejects_bad_values(kwargs: dict, field: str) -> None:
    # The worker's engine section (worker_options.EngineConfig) validates its own fields.
    with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
        GenerationWorkerConfig(model_path="m", engine=EngineConfig(**kwargs))


class _RecordingVerifier:
    """Test double for the verifier pool: reward 1 for completions equal to the gold answer."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[list[str]] = []
        self.fail = fail

    async def score(self, completions: list[str], gt_answer: str) -> list[RewardResult]:
        self.calls.append(list(completions))
        if self.fail:
            raise ConnectionError("verifier pool unreachable")
        return [RewardResult(reward=float(c == gt_answer), failed=False, error="") for c in completions]


def test_scoring_skips_truncated_and_keeps_order() -> None:
    verifier = _RecordingVerifier()
    worker = GenerationWorker("unit", GenerationWorkerConfig(model_path="unused"), verifier=verifier)
    texts, truncated = ["7", "7", "3", "7"], [False, True, False, True]
    got = asyncio.run(worker.score_completions(texts, truncated, "7", truncated_reward=-0.5))
    assert [r.reward for r in got] == [1.0, -0.5, 0.0, -0.5]
    assert verifier.calls == [["7", "3"]]
    got_all = asyncio.run(worker.score_completions(texts, truncated, "7", truncated_reward=None))
    assert [r.reward for r in got_all] == [1.0, 1.0, 0.0, 1.0]


def test_scoring_survives_verifier_failure() -> None:
    worker = GenerationWorker("unit", GenerationWorkerConfig(model_path="unused"), verifier=_RecordingVerifier(fail=True))
    got = asyncio.run(worker.score_completions(["7", "8"], [False, False], "7", truncated_reward=0.0))
    assert [(r.reward, r.failed) for r in got] == [(0.0, True), (0.0, True)]
    assert "unreachable" in got[0].error


class _TableVerifier:
    """Test double for the verifier pool: the result of each completion from a table."""

    def __init__(self, table: dict[str, RewardResult]) -> None:
        self.table = table
        self.calls: list[list[str]] = []

    async def score(self, completions: list[str], gt_answer: str) -> list[RewardResult]:
        self.calls.append(list(completions))
        return [self.table[c] for c in completions]


def _fake_completion(index: int, text: str, finish_reason: str) -> SimpleNamespace:
    """What the worker reads of a vLLM CompletionOutput; one token per character."""
    tokens = [ord(c) for c in text]
    return SimpleNamespace(
        index=index, text=text, token_ids=tokens, finish_reason=finish_reason,
        logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in tokens],
    )


@pytest.mark.parametrize("truncated_reward", [0.0, None])
def test_generate_adds_the_format_bonus_or_penalty_and_counts_it(truncated_reward: float | None) -> None:
    ok = RewardResult(reward=1.0, failed=False, error="")
    wrong = RewardResult(reward=0.0, failed=False, error="")
    unparsable = RewardResult(reward=0.0, failed=True, error="parse_error: no answer found in completion",
                              kind=FailureKind.PARSE_ERROR)
    # (text, finish reason, verifier's result), and the reward expected with \boxed{} required
    # (bonus 0.1, penalty 0.2), decided by hand.
    rows = [
        ("so \\boxed{7}", "stop", ok, 1.1),
        ("so 7", "stop", ok, 0.8),
        ("so \\boxed{8}", "stop", wrong, 0.1),
        ("no idea", "stop", unparsable, -0.2),
        # Cut off: truncated_reward 0.0 unverified and unshaped; None verifies (math-verify reads 7) and shapes.
        ("\\boxed{7", "length", ok, 0.0 if truncated_reward is not None else 0.8),
    ]
    verifier = _TableVerifier({text: result for text, _, result, _ in rows})
    worker = GenerationWorker("unit", GenerationWorkerConfig(model_path="unused"), verifier=verifier)

    async def fake_engine(sample: Sample, sampling: SamplingConfig, adapter: Any = None) -> list[SimpleNamespace]:
        return [_fake_completion(i, text, finish) for i, (text, finish, _, _) in enumerate(rows)]

    worker._run_engine = fake_engine  # type: ignore[method-assign]
    sampling = SamplingConfig(
        n=len(rows), truncated_reward=truncated_reward,
        reward=RewardConfig(format_pattern=r"\\boxed\{.+\}", format_bonus=0.1, format_penalty=0.2),
    )
    samples = asyncio.run(worker.generate(Sample(input_token_ids=[1], gt_answer="7", prompt_id=0), sampling))

    expected = [reward for *_, reward in rows]
    assert [s.reward for s in samples] == pytest.approx(expected, abs=1e-12)
    assert [s.reward_failed for s in samples] == [False, False, False, True, False]
    # The reason travels as the verifier's typed kind, not parsed from its error text.
    assert [s.reward_failure_reasons for s in samples][3] == ["math_verify/parse_error"]
    assert all(s.advantage == 0.0 for s in samples), "advantages are the batcher's, not the worker's"
    verified = len(rows) - 1 if truncated_reward is not None else len(rows)
    assert verifier.calls == [[text for text, *_ in rows[:verified]]]
    stats = worker.stats
    assert (stats.format_checked, stats.format_matched) == (verified, 2)
    assert (stats.samples, stats.truncated, stats.reward_failures) == (len(rows), 1, 1)


def test_generate_applies_the_soft_overlong_punishment() -> None:
    """DAPO's soft punishment, by hand: max_tokens 10, buffer 4, penalty 0.5 -> nothing up to 6
    tokens, 0.5 x (L - 6) / 4 above, the full 0.5 at 10 (the truncated one, rewarded 0 unverified)."""
    ok = RewardResult(reward=1.0, failed=False, error="")
    texts = ["7", "777777", "7777777", "777777777", "7777777777"]  # 1, 6, 7, 9, 10 tokens (one per char)
    finishes = ["stop", "stop", "stop", "stop", "length"]
    verifier = _TableVerifier({t: ok for t in texts})
    worker = GenerationWorker("unit", GenerationWorkerConfig(model_path="unused"), verifier=verifier)

    async def fake_engine(sample: Sample, sampling: SamplingConfig, adapter: Any = None) -> list[SimpleNamespace]:
        return [_fake_completion(i, text, finish) for i, (text, finish) in enumerate(zip(texts, finishes))]

    worker._run_engine = fake_engine  # type: ignore[method-assign]
    sampling = SamplingConfig(n=len(texts), max_tokens=10, overlong_buffer=4, overlong_penalty=0.5)
    samples = asyncio.run(worker.generate(Sample(input_token_ids=[1], gt_answer="7", prompt_id=0), sampling))
    assert [s.reward for s in samples] == pytest.approx([1.0, 1.0, 1.0 - 0.125, 1.0 - 0.375, 0.0 - 0.5])


@pytest.mark.system
def test_sampling_params_carry_stops_and_keep_stop_strings() -> None:
    worker = GenerationWorker("unit", GenerationWorkerConfig(model_path="unused"), verifier=_RecordingVerifier())
    params = worker._sampling_params(SamplingConfig(n=2, stop=["</answer>", "\n\n"], stop_token_ids=[5, 9]), 0)
    assert (params.stop, params.stop_token_ids) == (["</answer>", "\n\n"], [5, 9])
    assert params.include_stop_str_in_output
    plain = worker._sampling_params(SamplingConfig(n=2), 0)
    assert (plain.stop, plain.stop_token_ids, plain.ignore_eos) == ([], [], False)


def test_tied_lm_head_is_fed_only_when_tied_and_missing() -> None:
    class _Config:
        def __init__(self, tied: bool) -> None:
            self.tie_word_embeddings = tied

    embed = torch.ones(3, 2)
    weights = {"model.embed_tokens.weight": embed}
    assert with_tied_lm_head(weights, _Config(True))["lm_head.weight"] is embed
    assert "lm_head.weight" not in with_tied_lm_head(weights, _Config(False))
    own_head = torch.zeros(3, 2)
    given = {**weights, "lm_head.weight": own_head}
    assert with_tied_lm_head(given, _Config(True))["lm_head.weight"] is own_head


# ---------------------------------------------------------------- real verifier pool (Ray)


def test_hostile_and_truncated_outputs_through_scoring_path(ray_local, tiny_model_dir) -> None:
    worker = GenerationWorker("scoring-test", worker_config(tiny_model_dir))

    def score(texts: list[str], truncated: list[bool], gt: str, truncated_reward: float | None) -> list[RewardResult]:
        call = worker.score_completions(texts, truncated, gt, truncated_reward)
        return asyncio.run(asyncio.wait_for(call, HANG_GUARD_S))

    boxed_seven = "so the answer is $\\boxed{7}$"
    tower, boxed = score([EXPONENT_TOWER, boxed_seven], [False, False], "7", 0.0)
    # Caught by the pool's pre-checks before any verifier process sees it (math_verifier).
    assert (tower.reward, tower.failed) == (0.0, True) and tower.error.startswith("rejected: "), tower
    assert "exponent tower" in tower.error
    assert (boxed.reward, boxed.failed) == (expected_reward(boxed_seven, "7"), False) == (1.0, False)

    # math-verify reads a cut-off '9=9=' as the answer 9; the default policy pays 0 for it.
    assert expected_reward("9=9=", "9") == 1.0
    (cut,) = score(["9=9="], [True], "9", SamplingConfig().truncated_reward)
    assert (cut.reward, cut.failed) == (0.0, False)
    (cut_verified,) = score(["9=9="], [True], "9", None)
    assert (cut_verified.reward, cut_verified.failed) == (1.0, False)


# ---------------------------------------------------------------- real engine (vLLM in Ray)


@pytest.fixture(scope="module")
def failed_samples_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("failed") / "failed_samples.jsonl"


@pytest.fixture(scope="module")
def answering_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_answering_model(tiny_model_dir, tmp_path_factory.mktemp("answering") / "model")


@pytest.fixture(scope="module")
def generation_actor(ray_local, answering_model_dir, failed_samples_path):
    actor = _start_actor(ray_local, "generation-worker-test-0", worker_config(answering_model_dir, failed_samples_path))
    yield actor
    _stop_actor(ray_local, actor)


def _count_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.vllm
@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(n=16, max_tokens=6, seed=1234, truncated_reward=None),
        SamplingConfig(n=12, max_tokens=6, seed=99, truncated_reward=0.0),
    ],
    ids=["verify-truncated", "truncated-zero"],
)
def test_generate_rewards_advantages_versions(
    ray_local, generation_actor, answering_model_dir, failed_samples_path, sampling: SamplingConfig
) -> None:
    tokenizer = load_tokenizer(answering_model_dir)
    prompts = [("What is 3 + 4? ", "7"), ("Compute 14 / 2. ", "7"), ("6 + 1 = ", "7"), ("The prime after 5: ", "7")]
    samples = [_build_sample(text, gt, i, tokenizer) for i, (text, gt) in enumerate(prompts)]
    ray = ray_local
    served_version = ray.get(generation_actor.health.remote()).weight_version
    lines_before = _count_lines(failed_samples_path)

    groups = ray.get([generation_actor.generate.remote(s, sampling) for s in samples])

    reward_failures = 0
    all_rewards: list[float] = []
    for sample, group in zip(samples, groups):
        assert len(group) == sampling.n
        for rollout in group:
            assert rollout.input_token_ids == sample.input_token_ids and rollout.prompt_id == sample.prompt_id
            assert 1 <= len(rollout.output_token_ids) <= sampling.max_tokens
            assert len(rollout.sampling_logprobs) == len(rollout.output_token_ids)
            assert all(math.isfinite(lp) and lp <= 0.0 for lp in rollout.sampling_logprobs)
            assert rollout.output_text == tokenizer.decode(rollout.output_token_ids, skip_special_tokens=True)
            assert rollout.finish_reason in ("stop", "length")
            assert rollout.truncated == (rollout.finish_reason == "length")
            if rollout.truncated:
                assert len(rollout.output_token_ids) == sampling.max_tokens
            if rollout.truncated and sampling.truncated_reward is not None:
                assert (rollout.reward, rollout.reward_failed) == (sampling.truncated_reward, False)
            else:
                assert rollout.reward == expected_reward(rollout.output_text, sample.gt_answer)
            assert rollout.weight_version == served_version
            reward_failures += rollout.reward_failed
            all_rewards.append(rollout.reward)
        # Seeds differ per completion, so the n completions are not copies of one another.
        assert len({tuple(r.output_token_ids) for r in group}) > 1

    # The answering model makes these checks non-trivial: some rollouts are right, some wrong.
    assert {0.0, 1.0} <= set(all_rewards)
    records = [json.loads(line) for line in failed_samples_path.read_text().splitlines()[lines_before:]] if reward_failures else []
    assert len(records) == reward_failures
    assert all(r["error"].startswith("reward failed") and r["output_token_ids"] for r in records)


@pytest.mark.vllm
def test_weight_update_reaches_engine(
    ray_local, generation_actor, answering_model_dir, tiny_model_dir, tmp_path: Path
) -> None:
    """The engine serves the answering model; the update swaps in the seeded perturbation of the
    random tiny model, which HF loads from a saved copy."""
    tokenizer = load_tokenizer(answering_model_dir)
    sample = _build_sample("Find x if 2x = 14. ", "7", 0, tokenizer)
    old_dir = answering_model_dir

    before = _greedy(ray_local, generation_actor, sample)
    assert _max_diff(before.sampling_logprobs,
                     reference_logprobs(old_dir, sample.input_token_ids, before.output_token_ids)) <= LOGPROB_ATOL

    new_dir = tmp_path / "perturbed"
    state_dict = perturbed_copy(tiny_model_dir, new_dir, seed=7)
    version = before.weight_version + 1
    update = WeightUpdate(version=version, shard_refs=[ray_local.put(state_dict_to_blobs(state_dict))])
    assert ray_local.get(generation_actor.update_weights.remote(update)) == version

    after = _greedy(ray_local, generation_actor, sample)
    assert after.weight_version == version
    new_hf = reference_logprobs(new_dir, sample.input_token_ids, after.output_token_ids)
    old_hf = reference_logprobs(old_dir, sample.input_token_ids, after.output_token_ids)
    assert _max_diff(after.sampling_logprobs, new_hf) <= LOGPROB_ATOL
    assert _max_diff(after.sampling_logprobs, old_hf) >= MIN_OLD_NEW_GAP
    health = ray_local.get(generation_actor.health.remote())
    assert (health.weight_version, health.healthy, health.inflight_requests) == (version, True, 0)

    # The actor is shared by this module's later tests, which expect the answering model: push it back.
    from safetensors.torch import load_file

    answering = load_file(str(answering_model_dir / "model.safetensors"))
    restore = WeightUpdate(version=version + 1, shard_refs=[ray_local.put(state_dict_to_blobs(answering))])
    assert ray_local.get(generation_actor.update_weights.remote(restore)) == version + 1
    restored = _greedy(ray_local, generation_actor, sample)
    assert restored.output_token_ids == before.output_token_ids


def _tensor(num_floats: int) -> torch.Tensor:
    return torch.zeros(num_floats, dtype=torch.float32)


def test_reload_buckets_cut_only_between_decoder_layers_within_the_budget() -> None:
    layer = lambda i, part: f"model.layers.{i}.{part}.weight"  # noqa: E731
    stream = [("model.embed_tokens.weight", _tensor(10))]
    for i in range(3):
        stream += [(layer(i, "self_attn.q_proj"), _tensor(4)), (layer(i, "self_attn.k_proj"), _tensor(2)),
                   (layer(i, "mlp.gate_proj"), _tensor(4))]
    stream += [("model.norm.weight", _tensor(1)), ("lm_head.weight", _tensor(10))]
    # Budget 11 floats = 44 bytes: each layer (10 floats) fits alone, two do not.
    buckets = list(reload_buckets(iter(stream), bucket_bytes=44))
    names = [list(bucket) for bucket, _ in buckets]
    assert names == [
        ["model.embed_tokens.weight"],
        [layer(0, "self_attn.q_proj"), layer(0, "self_attn.k_proj"), layer(0, "mlp.gate_proj")],
        [layer(1, "self_attn.q_proj"), layer(1, "self_attn.k_proj"), layer(1, "mlp.gate_proj")],
        [layer(2, "self_attn.q_proj"), layer(2, "self_attn.k_proj"), layer(2, "mlp.gate_proj"), "model.norm.weight"],
        ["lm_head.weight"],
    ]
    assert [is_last for _, is_last in buckets] == [False, False, False, False, True]
    # Every tensor exactly once, in order; a budget larger than everything gives one last bucket.
    assert [n for bucket in names for n in bucket] == [n for n, _ in stream]
    (whole, is_last), = reload_buckets(iter(stream), bucket_bytes=10**6)
    assert list(whole) == [n for n, _ in stream] and is_last
    # A layer bigger than the budget travels alone rather than being split.
    assert [list(b) for b, _ in reload_buckets(iter(stream[1:4]), bucket_bytes=1)] == [[n for n, _ in stream[1:4]]]


def test_reload_buckets_refuse_a_layer_split_across_buckets() -> None:
    stream = [("model.layers.0.a.weight", _tensor(4)), ("model.layers.1.a.weight", _tensor(4)),
              ("model.layers.0.b.weight", _tensor(4))]
    with pytest.raises(ValueError, match="layer 0"):
        list(reload_buckets(iter(stream), bucket_bytes=1))


@pytest.mark.vllm
def test_weight_update_with_tied_embeddings(ray_local, tiny_tied_model_dir, tmp_path: Path) -> None:
    """Tied models: the update matches HF whether or not the state dict carries lm_head.weight
    (HF checkpoints of tied models omit it; a plain state_dict() includes it). The worker streams
    the update one decoder layer per reload (a 1-byte bucket budget), the path a model far larger
    than a bucket takes; the untied test above loads it in one bucket."""
    actor = _start_actor(ray_local, "generation-worker-test-tied",
                         worker_config(tiny_tied_model_dir, weight_reload_bucket_bytes=1))
    try:
        tokenizer = load_tokenizer(tiny_tied_model_dir)
        sample = _build_sample("1 + 1 = ", "2", 0, tokenizer)
        for version, keep_lm_head in ((1, False), (2, True)):
            new_dir = tmp_path / f"tied-v{version}"
            state_dict = perturbed_copy(tiny_tied_model_dir, new_dir, seed=100 + version)
            if not keep_lm_head:
                state_dict.pop("lm_head.weight")
            update = WeightUpdate(version=version, shard_refs=[ray_local.put(state_dict_to_blobs(state_dict))])
            assert ray_local.get(actor.update_weights.remote(update)) == version
            rollout = _greedy(ray_local, actor, sample)
            new_hf = reference_logprobs(new_dir, sample.input_token_ids, rollout.output_token_ids)
            old_hf = reference_logprobs(tiny_tied_model_dir, sample.input_token_ids, rollout.output_token_ids)
            assert rollout.weight_version == version
            assert _max_diff(rollout.sampling_logprobs, new_hf) <= LOGPROB_ATOL
            assert _max_diff(rollout.sampling_logprobs, old_hf) >= MIN_OLD_NEW_GAP
    finally:
        _stop_actor(ray_local, actor)


def _generation_counters(ray, actor) -> dict[str, int]:
    """The worker's GenerationStats, read from its health detail ('generation/<name>=<count>, ...')."""
    detail = ray.get(actor.health.remote()).detail
    items = (item.split("=") for item in detail.split(", "))
    return {key: int(value) for key, value in items if "/" in key}  # not endpoint= or engine_core=


def _without_eos(rollout: Sample, eos: int) -> list[int]:
    tokens = rollout.output_token_ids
    return tokens[:-1] if tokens and tokens[-1] == eos else tokens


def test_only_an_eager_engine_starts_its_core_without_torch_compile() -> None:
    assert engine_process_env(EngineConfig(enforce_eager=True)) == {"TORCHDYNAMO_DISABLE": "1"}
    assert engine_process_env(EngineConfig()) == {}


@pytest.mark.vllm
def test_the_actor_forks_its_eager_engines_core_which_then_samples(ray_local, generation_actor,
                                                                   answering_model_dir) -> None:
    """The worker actor forks its eager engine's core (inference/engine_process.py) instead of vLLM's
    spawn: the core is the actor's child, titled as vLLM titles it, and serves a sampled batch
    with logprobs (the path whose sampler helpers torch.compile would build kernels for; the
    fork has compile off: tests/inference/test_engine_process.py). The actor's own environment is
    left without TORCHDYNAMO_DISABLE."""
    assert "engine_core=fork" in ray_local.get(generation_actor.health.remote()).detail
    actor_pid = ray_local.get(generation_actor.__ray_call__.remote(lambda _actor: os.getpid()))
    (core,) = engine_core_processes(generation_actor)
    assert core.ppid() == actor_pid and core.cmdline()[0].strip() == "VLLM::EngineCore"
    tokenizer = load_tokenizer(answering_model_dir)
    sampled = ray_local.get(generation_actor.generate.remote(
        _build_sample("What is 3 + 4? ", "7", 0, tokenizer), SamplingConfig(n=4, max_tokens=4, temperature=1.0)))
    assert len(sampled) == 4 and all(len(s.sampling_logprobs) == len(s.output_token_ids) > 0 for s in sampled)
    actor_value = ray_local.get(generation_actor.__ray_call__.remote(
        lambda _actor: os.environ.get("TORCHDYNAMO_DISABLE")))
    assert actor_value is None


@pytest.mark.vllm
def test_stop_strings_stop_token_ids_and_eos(ray_local, generation_actor, answering_model_dir) -> None:
    """One seed, three requests: no stop, the stop string "73" (with a format reward), the stop
    token "3". A stop cuts the unstopped completion right after the stop's last token, which stays
    in the tokens and the text; EOS stays the last token and is left out of the text."""
    tokenizer = load_tokenizer(answering_model_dir)
    eos = tokenizer.eos_token_id
    (three,) = tokenizer.encode("3")
    sample = _build_sample("What is 3 + 4? ", "7", 0, tokenizer)
    plain_sampling = SamplingConfig(n=16, max_tokens=8, seed=STOP_TEST_SEED, truncated_reward=0.0)
    stop_sampling = replace(plain_sampling, stop=("73",), reward=STARTS_WITH_SEVEN)
    token_sampling = replace(plain_sampling, stop_token_ids=(three,))
    counters_before = _generation_counters(ray_local, generation_actor)
    plain, by_string, by_token = ray_local.get(
        [generation_actor.generate.remote(sample, s) for s in (plain_sampling, stop_sampling, token_sampling)]
    )
    counters_after = _generation_counters(ray_local, generation_actor)

    for rollout in plain + by_string + by_token:
        assert len(rollout.sampling_logprobs) == len(rollout.output_token_ids) >= 1
        assert rollout.output_text == tokenizer.decode(rollout.output_token_ids, skip_special_tokens=True)
        assert rollout.truncated == (rollout.finish_reason == "length")

    # EOS: the last trained token (with its sampling logprob), not in the text; a completion cut at
    # max_tokens has no EOS.
    assert {r.finish_reason for r in plain} == {"stop", "length"}
    for rollout in plain:
        if rollout.finish_reason == "stop":
            assert rollout.output_token_ids[-1] == eos and eos not in rollout.output_token_ids[:-1]
        else:
            assert eos not in rollout.output_token_ids and len(rollout.output_token_ids) == plain_sampling.max_tokens
        assert tokenizer.eos_token not in rollout.output_text

    # The tiny tokenizer is one character per token, so a text position is a token position.
    cut_by_string = cut_by_token = 0
    for unstopped, stopped in zip(plain, by_string):
        at = tokenizer.decode(_without_eos(unstopped, eos)).find("73")
        if at >= 0:
            assert stopped.output_token_ids == unstopped.output_token_ids[: at + 2]
            assert stopped.output_text.endswith("73") and "73" not in stopped.output_text[:-1]
            assert (stopped.finish_reason, stopped.truncated) == ("stop", False)
            cut_by_string += 1
        else:
            assert stopped.output_token_ids == unstopped.output_token_ids
            assert (stopped.finish_reason, stopped.truncated) == (unstopped.finish_reason, unstopped.truncated)
        kept = len(stopped.sampling_logprobs)
        assert stopped.sampling_logprobs == pytest.approx(unstopped.sampling_logprobs[:kept], abs=1e-6)
    for unstopped, stopped in zip(plain, by_token):
        if three in unstopped.output_token_ids:
            at = unstopped.output_token_ids.index(three)
            assert stopped.output_token_ids == unstopped.output_token_ids[: at + 1]
            assert stopped.output_text.endswith("3")  # a stop token that is not special stays in the text
            assert (stopped.finish_reason, stopped.truncated) == ("stop", False)
            cut_by_token += 1
        else:
            assert stopped.output_token_ids == unstopped.output_token_ids
            assert (stopped.finish_reason, stopped.truncated) == (unstopped.finish_reason, unstopped.truncated)
    n = plain_sampling.n
    assert 0 < cut_by_string < n and 0 < cut_by_token < n, (cut_by_string, cut_by_token)

    # The format reward rides on the verdict of the text the tokens decode to; truncated keeps 0.
    checked = [r for r in by_string if not r.truncated]
    for rollout in by_string:
        if rollout.truncated:
            assert rollout.reward == stop_sampling.truncated_reward
        else:
            shift = 0.5 if rollout.output_text.startswith("7") else -0.25
            assert rollout.reward == pytest.approx(expected_reward(rollout.output_text, "7") + shift, abs=1e-12)
    matched = sum(r.output_text.startswith("7") for r in checked)
    assert 0 < matched < len(checked)
    assert counters_after["generation/format_checked"] - counters_before["generation/format_checked"] == len(checked)
    assert counters_after["generation/format_matched"] - counters_before["generation/format_matched"] == matched


@pytest.mark.vllm
def test_seeded_requests_whose_prompts_overflow_one_step_are_served(ray_local, tiny_model_dir) -> None:
    """Three seeded requests with ~1,000-token prompts arrive together: more prompt tokens than
    one engine step takes (2,048). With vLLM's chunked prefill the third prompt was split across
    steps and the CPU sampler could not rewind its seeded generator ("CPU Generator does not use
    offset"): the engine died. Each request's tokens must equal the same request served alone."""
    config = worker_config(tiny_model_dir, engine=dict(max_model_len=_LONG_MODEL_LEN, kv_cache_memory_bytes=64 << 20))
    actor = _start_actor(ray_local, "generation-worker-test-long", config)
    try:
        tokenizer = load_tokenizer(tiny_model_dir)
        samples = [_build_sample(f"{i}+{i}=" * 250, "0", 700 + i, tokenizer) for i in range(3)]
        assert all(_LONG_PROMPT_TOKENS <= len(s.input_token_ids) < _LONG_MODEL_LEN - 4 for s in samples)
        sampling = SamplingConfig(n=2, max_tokens=2, temperature=1.0, seed=7)
        together = ray_local.get([actor.generate.remote(s, sampling) for s in samples])
        alone = [ray_local.get(actor.generate.remote(s, sampling)) for s in samples]
        assert [[r.output_token_ids for r in g] for g in together] == [[r.output_token_ids for r in g] for g in alone]
        assert ray_local.get(actor.health.remote()).healthy
    finally:
        _stop_actor(ray_local, actor)


def test_a_replaced_adapter_leaves_the_engine_once_its_last_request_ends() -> None:
    removed: list[int] = []

    async def remove(adapter_id: int) -> None:
        removed.append(adapter_id)

    async def scenario() -> None:
        book = AdapterBook(remove)
        assert book.acquire() is None  # no adapter: the engine's own weights
        first = SimpleNamespace(lora_int_id=book.new_id())
        await book.replace(first)
        a, b = book.acquire(), book.acquire()
        assert a is b is first
        second = SimpleNamespace(lora_int_id=book.new_id())
        await book.replace(second)
        assert (first.lora_int_id, second.lora_int_id) == (1, 2) and book.acquire() is second
        await book.release(first.lora_int_id)
        assert removed == []  # one request still runs on the first adapter
        await book.release(first.lora_int_id)
        assert removed == [1]
        await book.release(second.lora_int_id)
        assert removed == [1]  # the served adapter stays, requests or not
        await book.replace(None)
        assert removed == [1, 2] and book.acquire() is None

    asyncio.run(scenario())


def test_the_failed_sample_log_appends_one_record_per_failure(tmp_path: Path) -> None:
    sample = Sample(input_token_ids=[1, 2], gt_answer="7", prompt_id=3)
    FailedSampleLog(None, "w").record([(sample, "ignored")])  # None: off, nothing written
    log = FailedSampleLog(str(tmp_path / "sub" / "failed.jsonl"), "worker-0")
    log.record([])
    log.record([(sample, "generation failed: X")])
    log.record([(sample, "reward failed: Y")])
    records = [json.loads(line) for line in (tmp_path / "sub" / "failed.jsonl").read_text().splitlines()]
    assert [(r["worker"], r["error"], r["prompt_id"], r["gt_answer"]) for r in records] == [
        ("worker-0", "generation failed: X", 3, "7"), ("worker-0", "reward failed: Y", 3, "7")]
