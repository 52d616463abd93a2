"""LoRA adapters as the tests use them: the training tests' LoRA settings and a nonzero starting
adapter (tests/trainer/test_lora_fsdp.py, tests/weights/test_lora_push.py), and the lora_files
weight updates a worker takes, with the STABLE marker that names them (the vLLM and logprob worker
tests)."""

from __future__ import annotations

from pathlib import Path

import torch

from async_grpo.weights.adapter_files import StableMarker, update_parts, write_stable_marker
from async_grpo.weights.update import WeightUpdate

LORA = {"r": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                  "gate_proj", "up_proj", "down_proj"]}


def reference_peft(model_dir: Path):
    """An unsharded PEFT model with a nonzero adapter (lora_B starts at zero in a fresh one,
    which would make the shard check vacuous for half the tensors)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules=LORA["target_modules"])
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))
    return model


def files_update(adapter: Path, version: int, marker: Path) -> WeightUpdate:
    return WeightUpdate(version=version, mode="lora_files", adapter_config=(adapter / "adapter_config.json").read_text(),
                        adapter_path=str(adapter), marker_path=str(marker))


def mark_stable(update: WeightUpdate) -> None:
    write_stable_marker(Path(update.marker_path),
                        StableMarker(version=update.version, mode=update.mode, shards=update_parts(update)))
