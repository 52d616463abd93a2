"""LoRA settings at load time: model.lora flags, early errors naming the field, the worker-side
rank vLLM accepts.

    .venv/bin/python -m pytest tests/config/test_lora_config.py -q
"""

from __future__ import annotations

import pytest

from async_grpo.config.run_config import ConfigError, load_config
from async_grpo.config.worker_options import EngineConfig, vllm_lora_rank
from async_grpo.data.dataset import DatasetConfig
from async_grpo.trainer.config import TrainerConfig
from setup_model import DEFAULT_LORA_TARGETS, LoraConfig, ModelConfig
from vllm_worker import GenerationWorkerConfig

REQUIRED = ["--model.model_path", "m", "--data.path", "d.jsonl"]


def test_lora_is_off_by_default_and_set_by_flags() -> None:
    assert not load_config(TrainerConfig, REQUIRED).model.lora.enabled
    config = load_config(TrainerConfig, REQUIRED + ["--model.lora.r", "16", "--model.lora.alpha", "32",
                                                    "--model.lora.target_modules", "q_proj", "v_proj",
                                                    "--weight_push_mode", "lora_files"])
    assert config.model.lora == LoraConfig(r=16, alpha=32.0, target_modules=("q_proj", "v_proj"))
    assert config.weight_push_mode == "lora_files"
    assert LoraConfig(r=8).target_modules == DEFAULT_LORA_TARGETS


@pytest.mark.parametrize("kwargs,field", [
    ({"r": -1}, "LoraConfig.r"),
    ({"r": 1024}, "LoraConfig.r"),
    ({"r": 8, "alpha": 0.0}, "LoraConfig.alpha"),
    ({"r": 8, "dropout": 1.0}, "LoraConfig.dropout"),
    ({"r": 8, "target_modules": ()}, "LoraConfig.target_modules"),
    ({"r": 8, "target_modules": ("q_proj", "lm_head")}, "LoraConfig.target_modules"),
])
def test_bad_lora_settings_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LoraConfig(**kwargs)


def test_lora_files_needs_a_lora_policy() -> None:
    with pytest.raises(ConfigError, match="weight_push_mode lora_files"):
        load_config(TrainerConfig, REQUIRED + ["--weight_push_mode", "lora_files"])
    TrainerConfig(model=ModelConfig(model_path="m", lora=LoraConfig(r=8)), data=DatasetConfig(path="d.jsonl"),
                  weight_push_mode="lora_files")


@pytest.mark.parametrize("r,rank", [(1, 1), (2, 8), (8, 8), (9, 16), (64, 64), (300, 320)])
def test_vllm_lora_rank_is_the_smallest_accepted_rank_that_fits(r: int, rank: int) -> None:
    assert vllm_lora_rank(r) == rank


def test_generation_worker_refuses_a_rank_vllm_does_not_serve() -> None:
    with pytest.raises(ValueError, match="EngineConfig.max_lora_rank"):
        GenerationWorkerConfig(model_path="m", engine=EngineConfig(max_lora_rank=12))
    assert GenerationWorkerConfig(model_path="m", engine=EngineConfig(max_lora_rank=16)).engine.max_lora_rank == 16
