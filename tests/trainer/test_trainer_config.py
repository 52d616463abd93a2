"""TrainerConfig at load time: the token budget bounds every sample, the push dtype, and what
`trainer_core.py` says when it is started without a config."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from async_grpo.batching.batcher_config import ExperienceConfig
from async_grpo.config.run_config import load_config
from async_grpo.data.dataset import DatasetConfig
from async_grpo.config.sampling import SamplingConfig
from async_grpo.trainer.config import TrainerConfig
from async_grpo.trainer.fsdp_setup import DistInfo
from grpo_loss import LossConfig
from setup_model import ModelConfig
from support.paths import REPO_ROOT
from trainer_core import CONFIG_ERROR_EXIT, make_batcher_config, make_weight_pusher

TRAINER = REPO_ROOT / "trainer_core.py"
# Importing the trainer (torch, Ray, transformers) takes ~10 s on the 2 shared cores.
START_TIMEOUT_S = 120


def _config(**overrides) -> TrainerConfig:
    """A TrainerConfig; overrides of the experience section's fields (max_lag, sampling, ...) go into it."""
    shared = {f.name for f in fields(ExperienceConfig)}
    experience = ExperienceConfig(**{k: v for k, v in overrides.items() if k in shared})
    sections = {"model": ModelConfig(model_path="m"), "data": DatasetConfig(path="d.jsonl"), "experience": experience}
    return TrainerConfig(**{**sections, **{k: v for k, v in overrides.items() if k not in shared}})


def _budget_config(max_prompt_tokens: int, max_tokens: int, max_tokens_per_gpu: int, **overrides) -> TrainerConfig:
    return _config(data=DatasetConfig(path="d.jsonl", max_prompt_tokens=max_prompt_tokens),
                   sampling=SamplingConfig(max_tokens=max_tokens), max_tokens_per_gpu=max_tokens_per_gpu,
                   **overrides)


def test_budget_must_hold_the_longest_sample() -> None:
    _budget_config(100, 28, 128)  # exactly the longest sample: fine
    with pytest.raises(ValueError, match=r"TrainerConfig.max_tokens_per_gpu=127 is below data.max_prompt_tokens \+ "
                                         r"sampling.max_tokens = 100 \+ 28 = 128.*oversized_sample_policy"):
        _budget_config(100, 28, 127)
    # 128 tokens over a 50-token budget: one rank of 128 or a context-parallel group of 3 holds them.
    with pytest.raises(ValueError, match="raise max_tokens_per_gpu to at least 128 or model.context_parallel to at "
                                         "least 3 "):
        _budget_config(100, 28, 50)
    # An explicit policy accepts it: such a sample trains alone, over the budget, and is counted.
    assert _budget_config(100, 28, 127, oversized_sample_policy="train_alone").experience.max_tokens_per_gpu == 127
    assert _config().oversized_sample_policy == "refuse"


def test_a_multi_turn_rollout_must_fit_the_budget_and_its_environment_must_import(tmp_path: Path) -> None:
    from async_grpo.config.rollout_sources import EnvironmentConfig
    from async_grpo.trainer.run_inputs import InputError, load_run_inputs

    def with_environment(name: str, max_total_tokens: int, max_tokens_per_gpu: int) -> TrainerConfig:
        environment = EnvironmentConfig(name=name, max_total_tokens=max_total_tokens)
        return _config(sampling=SamplingConfig(max_tokens=16, environment=environment),
                       max_tokens_per_gpu=max_tokens_per_gpu)

    # The whole stream (observations included) bounds a sample, not max_prompt_tokens + max_tokens.
    fits = with_environment("async_grpo.rollouts.tool_environment:ToolEnvironment", 4096, 4096)
    assert fits.experience.max_tokens_per_gpu == 4096
    with pytest.raises(ValueError, match=r"max_tokens_per_gpu=4095 is below sampling.environment.max_total_tokens=4096"):
        with_environment("async_grpo.rollouts.tool_environment:ToolEnvironment", 4096, 4095)
    # A class that does not import stops the run before the model folder is even read.
    config = with_environment("async_grpo.rollouts.tool_environment:NoSuchEnvironment", 1024, 4096)
    with pytest.raises(InputError, match="has no class 'NoSuchEnvironment'"):
        load_run_inputs(config, with_evaluator=False)


def test_the_rule_is_checked_at_load_time_and_the_demo_satisfies_it() -> None:
    required = ["--model.model_path", "m", "--data.path", "d.jsonl", "--eval.every", "0"]
    demo = load_config(TrainerConfig, ["--config", str(REPO_ROOT / "configs" / "demo.yaml"), *required])
    assert demo.data.max_prompt_tokens + demo.experience.sampling.max_tokens <= demo.experience.max_tokens_per_gpu
    with pytest.raises(ValueError, match="max_tokens_per_gpu=8 is below"):
        load_config(TrainerConfig, ["--config", str(REPO_ROOT / "configs" / "demo.yaml"), *required,
                                    "--max_tokens_per_gpu", "8"])
    _config()  # the defaults (1024 + 512 <= 8192) too


@pytest.mark.parametrize(
    "setting, device, mixed_precision, expected",
    [
        ("auto", "cuda", True, torch.bfloat16),
        ("auto", "cuda", False, torch.float32),
        ("auto", "cpu", True, torch.float32),
        ("bfloat16", "cpu", True, torch.bfloat16),
    ],
)
def test_weight_push_dtype_reaches_the_pusher(setting: str, device: str, mixed_precision: bool,
                                               expected: torch.dtype) -> None:
    config = _config(weight_push_dtype=setting, model=ModelConfig(model_path="m", mixed_precision=mixed_precision))
    # Rank 1 of a gather push holds no registries and needs no Ray: the device is only named.
    dist = DistInfo(rank=1, world_size=2, local_rank=1, device=torch.device(device), backend="gloo")
    assert make_weight_pusher(config, dist).dtype == expected
    assert _config().weight_push_dtype == "auto"


def _start_trainer(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return subprocess.run([sys.executable, str(TRAINER), *args], cwd=tmp_path, env={**base, **env},
                          capture_output=True, text=True, timeout=START_TIMEOUT_S)


@pytest.mark.system
def test_no_arguments_says_how_to_pass_a_config(tmp_path: Path) -> None:
    done = _start_trainer(tmp_path)
    assert done.returncode == CONFIG_ERROR_EXIT != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # one line, no traceback
    assert lines[0].startswith("trainer_core.py needs a config: --config FILE"), lines[0]
    assert "--model.model_path PATH --data.path FILE" in lines[0] and "see --help" in lines[0]
    assert not any(tmp_path.iterdir())  # it stopped before making a run directory (or anything else)


@pytest.mark.system
def test_a_bad_config_is_one_line_printed_by_each_nodes_first_rank(tmp_path: Path) -> None:
    # Under torchrun every rank parses the command line: only LOCAL_RANK 0 prints, all exit non-zero.
    silent = _start_trainer(tmp_path, "--model.model_path", "m", LOCAL_RANK="1", RANK="1", WORLD_SIZE="2")
    assert (silent.returncode, silent.stderr) == (CONFIG_ERROR_EXIT, "")
    done = _start_trainer(tmp_path, "--model.model_path", "m", "--data.path", "d.jsonl", "--max_tokens_per_gpu", "8",
                          LOCAL_RANK="0", RANK="0", WORLD_SIZE="2")
    assert done.returncode == CONFIG_ERROR_EXIT
    assert done.stderr.strip().splitlines() == [
        "trainer_core.py: TrainerConfig: TrainerConfig.max_tokens_per_gpu=8 is below data.max_prompt_tokens + "
        "sampling.max_tokens = 1024 + 512 = 1536: one sample could exceed the minibatch budget; raise "
        "max_tokens_per_gpu to at least 1536, lower data.max_prompt_tokens or "
        "sampling.max_tokens, or set oversized_sample_policy: train_alone"
    ]


@pytest.mark.parametrize("config_file", sorted(p.name for p in (REPO_ROOT / "configs").glob("*.yaml")))
def test_every_bundled_config_loads_into_the_trainer_config(config_file: str) -> None:
    """Each file under configs/ is a valid TrainerConfig (sections only, or whole runs), given the
    paths its header says to pass."""
    path = REPO_ROOT / "configs" / config_file
    generated = "format: reasoning_gym" in path.read_text()  # its prompts are generated: no data file
    config = load_config(TrainerConfig, ["--config", str(path), "--model.model_path", "m",
                                         *([] if generated else ["--data.path", "d.jsonl"]),
                                         "--eval.data.path", "e.jsonl"])
    assert config.data.max_prompt_tokens + config.experience.sampling.max_tokens <= config.experience.max_tokens_per_gpu


@pytest.mark.parametrize("every, at_end, expected", [
    (0, True, [4]), (0, False, []), (2, True, [1, 3, 4]), (2, False, [1, 3]), (5, False, [4]),
])
def test_checkpoint_schedule(every: int, at_end: bool, expected: list[int]) -> None:
    """Steps (0-based, of a 5-step run) after which a checkpoint is written."""
    from trainer_core import _should_checkpoint

    config = _config(num_steps=5, checkpoint_every=every, checkpoint_at_end=at_end)
    assert [s for s in range(5) if _should_checkpoint(s, config)] == expected


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"logprob_role": "none", "loss": LossConfig(kl_coef=0.1)}, "puts a KL term in the loss"),
        ({"logprob_role": "old_policy", "loss": LossConfig(kl_coef=0.1, kl_in_reward=True)},
         r"puts a KL term in the reward \(loss.kl_in_reward\).*old_policy with reference_pool true"),
        ({"logprob_role": "reference", "reference_pool": True}, "reference_pool goes with logprob_role old_policy"),
        ({"loss": LossConfig(kl_coef=0.1, kl_in_reward=True, kl_policy_logprobs="old_policy")},
         "kl_policy_logprobs old_policy needs logprob_role old_policy"),
    ],
)
def test_every_logprob_the_run_needs_has_a_service(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(**overrides)


def test_old_policy_with_a_reference_pool_serves_the_kl_from_either_side() -> None:
    for policy in ("sampler", "old_policy"):
        config = _config(logprob_role="old_policy", reference_pool=True,
                         loss=LossConfig(kl_coef=0.1, kl_in_reward=True, kl_policy_logprobs=policy))
        assert make_batcher_config(config, world_size=2).kl_in_reward.kl_policy_logprobs == policy
    assert _config(logprob_role="old_policy", reference_pool=True, loss=LossConfig(kl_coef=0.1)).loss.kl_in_loss


@pytest.mark.parametrize("num_steps, total_steps, expected", [(120, None, 120), (120, 450, 450)])
def test_the_cosine_schedule_ends_with_the_run_unless_set(num_steps: int, total_steps: int | None,
                                                          expected: int) -> None:
    from async_grpo.trainer.optimizer import OptimConfig, lr_factor

    optim = OptimConfig(lr=1.0, schedule="cosine", min_lr_ratio=0.1, total_steps=total_steps)
    config = _config(num_steps=num_steps, optim=optim)
    assert config.optim.total_steps == expected
    assert lr_factor(expected, config.optim) == pytest.approx(0.1)
    assert lr_factor(expected - 1, config.optim) > 0.1
