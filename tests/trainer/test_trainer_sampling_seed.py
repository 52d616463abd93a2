"""Reproducible rollout sampling: the run's seed reaches the engine, and every step draws afresh.

    .venv/bin/python -m pytest tests/trainer/test_trainer_sampling_seed.py -x -q

The seeds the engine would receive are read from GenerationWorker._sampling_params (the
SamplingParams the worker builds; no engine is started), fed by a real ExperienceBatcher whose
generation registry is a stand-in that records what each request carried.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from async_grpo.batching.batcher_config import BatcherConfig, ExperienceConfig
from async_grpo.config.run_config import load_config, save_config
from async_grpo.data.dataset import DatasetConfig
from async_grpo.config.sampling import SEED_BOUND, SamplingConfig, derive_seed
from async_grpo.trainer.config import TrainerConfig
from sample_processing_utils import Sample
from setup_model import ModelConfig
from vllm_experience_batcher import ExperienceBatcher, Minibatch
from vllm_worker import GenerationWorker, GenerationWorkerConfig

N = 4  # completions per request
PROMPT_IDS = range(6)
STEPS = range(3)


def _config(**overrides) -> TrainerConfig:
    return TrainerConfig(model=ModelConfig(model_path="unused"), data=DatasetConfig(path="unused.jsonl"), **overrides)


def test_trainer_seeds_sampling_from_the_run_seed_unless_told_otherwise() -> None:
    seeded = ExperienceConfig(sampling=SamplingConfig(seed=5))
    assert _config(seed=17).experience.sampling.seed == 17
    assert _config(seed=17, experience=seeded).experience.sampling.seed == 5  # an explicit seed wins
    assert _config(seed=17, seed_sampling=False).experience.sampling.seed is None
    with pytest.raises(ValueError, match="seed_sampling"):
        _config(seed_sampling=False, experience=seeded)
    with pytest.raises(ValueError, match="TrainerConfig.seed"):
        _config(seed=SEED_BOUND)


def test_resolved_seed_is_what_config_yaml_records(tmp_path: Path) -> None:
    """A rerun from the saved config.yaml samples with the same seed."""
    from async_grpo.data.dataset import DatasetConfig
    from setup_model import ModelConfig

    config = TrainerConfig(model=ModelConfig(model_path="m"), data=DatasetConfig(path="d.jsonl"), seed=3)
    save_config(config, tmp_path / "config.yaml")
    assert "seed: 3" in (tmp_path / "config.yaml").read_text().split("sampling:")[1]
    assert load_config(TrainerConfig, ["--config", str(tmp_path / "config.yaml")]) == config


def test_derive_seed_is_deterministic_in_range_and_spread() -> None:
    assert derive_seed(0, 1, 2) == derive_seed(0, 1, 2)
    # Neighbouring inputs are unrelated, unlike seed + step arithmetic (seed 0 step 1 == seed 1 step 0).
    assert derive_seed(0, 1) != derive_seed(1, 0)
    values = [derive_seed(base, key) for base in range(20) for key in range(500)]
    assert all(0 <= v < SEED_BOUND for v in values)
    assert len(set(values)) == len(values)
    assert all(0 <= derive_seed(3, k, bound=10) < 10 for k in range(100))
    # Roughly uniform: the mean of 10,000 uniform draws on [0, 1) is 0.5 +- 0.003 (1 sigma).
    assert abs(sum(values) / len(values) / SEED_BOUND - 0.5) < 0.02


class _RecordingGeneration:
    """Generation stand-in: n rollouts at weight version 0; records each request's sampling seed."""

    def __init__(self) -> None:
        self.seeds: dict[int, int | None] = {}

    async def submit(self, method: str, sample: Sample, sampling: SamplingConfig, *, cost: int) -> list[Sample]:
        assert method == "generate"
        self.seeds[sample.prompt_id] = sampling.seed
        return [Sample(input_token_ids=list(sample.input_token_ids), gt_answer="", prompt_id=sample.prompt_id,
                       output_token_ids=[2], sampling_logprobs=[-0.5], weight_version=0) for _ in range(sampling.n)]


def _engine_seeds(sampling: SamplingConfig) -> dict[tuple[int, int], int | None]:
    """(step, prompt_id) -> the seed the engine would get, for STEPS x PROMPT_IDS run by a batcher."""
    experience = ExperienceConfig(max_tokens_per_gpu=64, prompt_deadline_s=60.0, sampling=sampling,
                                  logprob_role="none", max_lag=len(STEPS))
    config = BatcherConfig(world_size=1, experience=experience)
    worker = GenerationWorker("seed-test", GenerationWorkerConfig(model_path="unused"))
    seeds: dict[tuple[int, int], int | None] = {}

    async def scenario() -> None:
        generation = _RecordingGeneration()
        batcher = ExperienceBatcher(config, generation, None)
        for step in STEPS:
            await batcher.submit_prompts(0, step, [Sample(input_token_ids=[1, 2], gt_answer="", prompt_id=p)
                                                   for p in PROMPT_IDS])
            while isinstance(await batcher.next_message(0, step), Minibatch):
                pass
            for prompt_id, seed in generation.seeds.items():
                sent = SamplingConfig(n=sampling.n, seed=seed)
                seeds[step, prompt_id] = worker._sampling_params(sent, prompt_id).seed
            generation.seeds.clear()

    asyncio.run(scenario())
    return seeds


@pytest.mark.system
def test_engine_seeds_differ_per_step_and_prompt_and_repeat_on_a_rerun() -> None:
    seeds = _engine_seeds(SamplingConfig(n=N, seed=11))
    assert set(seeds) == {(s, p) for s in STEPS for p in PROMPT_IDS}
    for prompt_id in PROMPT_IDS:
        # The same prompt drawn at another step gets other randomness.
        assert len({seeds[s, prompt_id] for s in STEPS}) == len(STEPS), prompt_id
    # No two requests' completion seeds (seed .. seed + n - 1, vLLM's per-completion seeds) overlap.
    completion_seeds = [seed + i for seed in seeds.values() for i in range(N)]
    assert len(set(completion_seeds)) == len(completion_seeds)
    assert all(0 <= s < SEED_BOUND for s in completion_seeds)
    assert _engine_seeds(SamplingConfig(n=N, seed=11)) == seeds
    assert _engine_seeds(SamplingConfig(n=N, seed=12)) != seeds
    assert set(_engine_seeds(SamplingConfig(n=N, seed=None)).values()) == {None}
