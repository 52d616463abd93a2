"""The real WeightPusher pushing a LoRA policy from 2 FSDP2 ranks, in every mode, read back as a
worker reads it (STABLE check, then the shards or the lora_files folder).

    .venv/bin/python -m pytest tests/weights/test_lora_push.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from async_grpo.weights.adapter_files import read_stable_marker
from support.forked_ranks import run_ranks
from support.lora_adapters import LORA, reference_peft
from support.paths import PROGRAMS

WORKER = PROGRAMS / "lora_push_worker.py"
WORLD_SIZE = 2
LAUNCH_TIMEOUT_S = 600
MODES = ("gather", "sharded", "lora_files")
PUSHES_PER_MODE = 2


@pytest.fixture(scope="module")
def pushed(ray_local, tmp_path_factory, tiny_model_dir: Path) -> dict:
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("lora-push")
    adapter_dir = root / "start-adapter"
    reference_peft(tiny_model_dir).save_pretrained(str(adapter_dir))
    out = root / "out"
    out.mkdir()
    context = ray_local.get_runtime_context()
    run_ranks(WORKER, ["--ray_address", context.gcs_address, "--namespace", context.namespace, "--out_dir", str(out),
                       "--model_path", str(tiny_model_dir), "--adapter_dir", str(adapter_dir)],
              WORLD_SIZE, LAUNCH_TIMEOUT_S)
    return {"received": torch.load(out / "received.pt"), "out": out,
            "expected": load_file(str(adapter_dir / "adapter_model.safetensors")),
            "expected_config": json.loads((adapter_dir / "adapter_config.json").read_text())}


def _versions(mode: str) -> list[int]:
    first = MODES.index(mode) * PUSHES_PER_MODE
    return list(range(first, first + PUSHES_PER_MODE))


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_delivers_the_unsharded_adapter(pushed: dict, mode: str) -> None:
    for version in _versions(mode):
        record = pushed["received"][version]
        assert record["mode"] == mode
        assert record["tensors"].keys() == pushed["expected"].keys()
        for name, tensor in pushed["expected"].items():
            assert torch.equal(record["tensors"][name], tensor), (mode, name)


@pytest.mark.distributed
@pytest.mark.parametrize("mode,parts", [("gather", 1), ("sharded", WORLD_SIZE), ("lora_files", 1)])
def test_stable_marker_names_each_version_and_its_parts(pushed: dict, mode: str, parts: int) -> None:
    for version in _versions(mode):
        record = pushed["received"][version]
        marker_version, marker_mode, shards = record["marker"]
        assert (marker_version, marker_mode, len(shards)) == (version, mode, parts)
        assert record["num_refs"] == (0 if mode == "lora_files" else parts)
    final = read_stable_marker(pushed["out"] / "weights" / "STABLE")
    assert final.version == len(MODES) * PUSHES_PER_MODE - 1 and final.mode == "lora_files"


@pytest.mark.distributed
def test_adapter_config_is_peft_loadable_with_the_trained_settings(pushed: dict) -> None:
    from peft import PeftConfig

    config = PeftConfig.from_peft_type(**json.loads(pushed["received"][0]["adapter_config"]))
    assert (config.r, config.lora_alpha, sorted(config.target_modules)) == (
        LORA["r"], LORA["alpha"], sorted(LORA["target_modules"]))
    assert config.peft_type == pushed["expected_config"]["peft_type"]


@pytest.mark.distributed
def test_lora_files_folders_are_complete_and_pruned(pushed: dict, tiny_model_dir: Path) -> None:
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    folders = sorted(p.name for p in (pushed["out"] / "weights").iterdir() if p.is_dir())
    assert folders == [f"step_{v:06d}" for v in _versions("lora_files")]
    latest = pushed["received"][_versions("lora_files")[-1]]["adapter_path"]
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    loaded = get_peft_model_state_dict(PeftModel.from_pretrained(base, latest))
    for name, tensor in pushed["expected"].items():
        assert torch.equal(loaded[name], tensor), name
